"""Build a model on its device and fill it from safetensors files or with random weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ragserve.generation.config import EngineConfig, ModelConfig, ModelLoadError
from ragserve.generation.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def load_model(
    cfg: ModelConfig,
    folder: Path | None,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> nn.Module:
    """The model in eval mode, materialised from the meta device directly on ``device``;
    ``config.load_format="dummy"``: random weights seeded by ``config.seed``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)  # every SUPPORTED_ARCHITECTURES entry
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build(device, dtype)
    if config.load_format == "dummy":
        _init_dummy(model, device, config.seed)
    else:
        if folder is None:
            raise ModelLoadError("a model folder is needed unless load_format='dummy'")
        _load_safetensors(model, folder)
    return model.eval()


@torch.no_grad()
def _init_dummy(model: nn.Module, device: torch.device, seed: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-0.02, 0.02, generator=gen)


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a model folder and, if sharded, the index's weight map."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"corrupt safetensors index {index_path}: {e!r}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"missing weight file {f} (listed in {index_path})")
        return files, weight_map
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {folder}")
    return files, {}


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own and OS errors for bad files
        raise ModelLoadError(f"corrupt or unreadable weight file {path}: {e}") from e


def _load_safetensors(model: nn.Module, folder: Path) -> None:
    files, weight_map = weight_files(folder)
    expected = model.expected_weight_names()
    loaded: set[str] = set()
    for path in files:
        for name, tensor in _iter_file(path):
            try:
                used = model.load_weight(name, tensor)
            except ValueError as e:
                raise ModelLoadError(f"{path}: {e}") from e
            if used:
                loaded.add(name)
            else:
                logger.debug("ignoring unused tensor %s in %s", name, path)
    missing = sorted(expected - loaded)
    if missing:
        where = weight_map.get(missing[0])
        source = str(folder / where) if where else ", ".join(str(f) for f in files)
        raise ModelLoadError(f"missing {len(missing)} weight(s) in {source}, e.g. {missing[:3]}")
