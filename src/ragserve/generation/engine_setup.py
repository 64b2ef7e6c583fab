"""The engine's set-up decisions, before any model is loaded: the device and dtype an
``EngineConfig`` names, the longest sequence the model allows, the KV pool's size, and the
tokenizer (with its end-of-sequence id) from a model folder."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ragserve.generation.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig, ModelConfig
from ragserve.generation.model_runner import kv_cache_bytes_per_block

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_dummy_dir(config: EngineConfig) -> bool:
    return config.load_format == "dummy" and (Path(config.model) / "config.json").is_file()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        # NOTE: within the window, sliding-window attention equals full attention.
        limit = min(limit, cfg.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {limit}")
    return config.max_model_len


def size_kv_pool(
    config: EngineConfig,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> tuple[int, int]:
    """``(num_blocks, max_model_len)``: the pool from ``kv_cache_bytes``, else on CUDA a share
    of the memory left after the weights, else (CPU) up to 32 full contexts within a modest
    default. An implicit ``max_model_len`` shrinks to the pool; an explicit one must fit."""
    per_block = kv_cache_bytes_per_block(cfg, config.block_size, dtype)
    if config.kv_cache_bytes is not None:
        pool_bytes = config.kv_cache_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        pool_bytes = int(free * config.kv_cache_memory_fraction)
    else:
        per_token = per_block // config.block_size
        pool_bytes = min(CPU_DEFAULT_KV_CACHE_BYTES, 32 * max_model_len * per_token)
    num_blocks = pool_bytes // per_block
    pool_tokens = num_blocks * config.block_size
    if pool_tokens < max_model_len:
        if config.max_model_len is not None or num_blocks < 1:
            raise ValueError(
                f"the KV pool holds {pool_tokens} tokens, less than max_model_len="
                f"{max_model_len}; raise kv_cache_bytes or lower max_model_len"
            )
        logger.warning("the KV pool holds %d tokens: max_model_len lowered", pool_tokens)
        max_model_len = pool_tokens
    return num_blocks, max_model_len


_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt",
)  # fmt: skip
_TOKENIZERS: dict[str, Any] = {}  # digest of the files -> tokenizer


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer (``None`` without one). NOTE: a load takes ~1 s; engines of one
    process whose folders hold the same tokenizer files share one tokenizer object (the
    engine only calls it and decodes with it, never configures it)."""
    files = [folder / n for n in _TOKENIZER_FILES if (folder / n).is_file()]
    if not any(f.name in _TOKENIZER_FILES[:3] for f in files):
        logger.info("no tokenizer in %s: prompts must be token ids", folder)
        return None
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    named, config = folder / "tokenizer_config.json", folder / "config.json"
    has_class = named.is_file() and "tokenizer_class" in json.loads(named.read_text())
    if not has_class and config.is_file():  # the tokenizer class comes from the model type
        digest.update(str(json.loads(config.read_text()).get("model_type")).encode())
    key = digest.hexdigest()
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(folder)
    return _TOKENIZERS[key]


def tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)
