"""The engine's set-up decisions: the device and dtype an ``EngineConfig`` names, the longest
sequence, the KV pool's size, the tokenizer of a model folder, and the KV tiers."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ragserve.generation.block_manager import BlockManager
from ragserve.generation.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig, ModelConfig
from ragserve.generation.kv_cache_manager import PrefillCostModel, TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache
from ragserve.generation.model_runner import kv_cache_bytes_per_block
from ragserve.generation.segments import whitespace_newline_counts

logger = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if config.device == "auto" else config.device)
    if config.dtype == "auto":
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return device, DTYPES[config.dtype]


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


def resolve_kv_pool(
    config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[EngineConfig, int]:
    """``(config resolved, num_blocks)``: ``kv_cache_bytes``, else a share of free CUDA memory,
    else (CPU) up to 32 full contexts; an implicit ``max_model_len`` shrinks to the pool."""
    max_model_len = resolve_max_model_len(config, cfg)
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
    resolved = replace(
        config,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_bytes=num_blocks * per_block,
        max_model_len=max_model_len,
    )
    return resolved, num_blocks


_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt",
)  # fmt: skip
_TOKENIZERS: dict[str, Any] = {}  # digest of the files -> tokenizer


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer (``None`` without one). NOTE: a load takes ~1 s; engines whose
    folders hold the same tokenizer files share one (the engine never configures it)."""
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


def make_kv_tiers(
    config: EngineConfig, model_config: ModelConfig, kv_cache: torch.Tensor, tokenizer: Any
) -> tuple[BlockManager | TieredBlockManager, HostKVCache | None]:
    """The block manager for ``config`` over ``kv_cache`` and the host tier (or ``None``)."""
    num_blocks = kv_cache.shape[2]
    if not (config.enable_prefix_caching and config.enable_knowledge_tree):
        return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching), None
    per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    num_host_blocks = config.host_kv_cache_bytes // per_block
    if config.host_kv_cache_bytes and num_host_blocks == 0:
        raise ValueError(
            f"host_kv_cache_bytes={config.host_kv_cache_bytes} holds no block of {per_block} bytes"
        )
    host = None
    if num_host_blocks:
        host = HostKVCache(
            kv_cache,
            num_host_blocks,
            overlap=config.overlap_swap_in,
            async_swap_out=config.async_swap_out,
        )
    manager = TieredBlockManager(
        num_blocks,
        config.block_size,
        num_host_blocks=num_host_blocks,
        policy=config.kv_eviction_policy,
        cost_fn=PrefillCostModel.from_flops(model_config),
        newline_counts=whitespace_newline_counts(tokenizer),
        swap_out_filter=config.swap_out_filter,
    )
    return manager, host
