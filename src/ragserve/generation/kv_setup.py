"""Builds the engine's KV tiers from its config, and reports their counters.

``make_kv_tiers`` picks the manager: the knowledge tree (``TieredBlockManager``, the default)
or the plain hashed-block prefix cache (``BlockManager``, ``enable_knowledge_tree=False`` or
prefix caching off), sizes the host tier from ``host_kv_cache_bytes`` and sets PGDSF's
prefill-cost model (``PrefillCostModel``: FLOP-derived until ``LLMEngine.profile_prefill_cost``
replaces it with measured times).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragserve.generation.block_manager import BlockManager
from ragserve.generation.config import EngineConfig, ModelConfig
from ragserve.generation.kv_cache_manager import TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache
from ragserve.generation.segments import whitespace_newline_counts


@dataclass(frozen=True)
class PrefillCostModel:
    """Prefill seconds of ``n`` new tokens after ``c`` cached ones:
    ``fixed_s + n * (per_token_s + per_token_context_s * (c + n / 2))``."""

    per_token_s: float
    per_token_context_s: float
    fixed_s: float = 0.0

    def __call__(self, num_tokens: int, num_context_tokens: int) -> float:
        attended = num_context_tokens + num_tokens / 2
        return self.fixed_s + num_tokens * (self.per_token_s + self.per_token_context_s * attended)

    @classmethod
    def from_flops(cls, cfg: ModelConfig) -> PrefillCostModel:
        """Relative costs from the model's shape (2 FLOPs per weight, 4 per attended key)."""
        weights = cfg.num_hidden_layers * (
            cfg.hidden_size
            * cfg.head_dim
            * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        return cls(per_token_s=2.0 * weights * 1e-12, per_token_context_s=attention * 1e-12)

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]]) -> PrefillCostModel:
        """Least squares over measured ``(num_tokens, num_context_tokens, seconds)``."""
        if len(samples) < 3:
            raise ValueError("samples: at least 3 measurements are needed to fit the model")
        rows = [(1.0, n, n * (c + n / 2)) for n, c, _ in samples]
        coef, *_ = np.linalg.lstsq(np.asarray(rows), np.asarray([s for *_, s in samples]))
        fixed, per_token, per_ctx = (max(float(x), 0.0) for x in coef)
        return cls(per_token_s=per_token, per_token_context_s=per_ctx, fixed_s=fixed)


@dataclass(frozen=True)
class SwapCostModel:
    """Seconds to swap ``n`` blocks in from the host tier: ``fixed_s + n * per_block_s``."""

    per_block_s: float
    fixed_s: float = 0.0

    def __call__(self, num_blocks: int) -> float:
        return self.fixed_s + num_blocks * self.per_block_s if num_blocks else 0.0


def profile_swap_cost(host: HostKVCache, num_gpu_blocks: int) -> SwapCostModel:
    """Time host-to-GPU copies of 1 .. 32 blocks into GPU blocks ``0 ..`` (an idle engine:
    every GPU block is free, so the copies overwrite nothing) and fit ``SwapCostModel``."""
    import time

    from ragserve.generation.kv_cache_manager import SwapOp

    samples = []
    for n in (1, 4, 16, 32, 1, 4, 16, 32):
        n = min(n, num_gpu_blocks, host.num_host_blocks)
        ops = [SwapOp("in", i, i) for i in range(n)]
        start = time.perf_counter()
        host.run(ops)
        host.synchronize()
        if host.gpu_cache.device.type == "cuda":
            import torch

            torch.cuda.synchronize(host.gpu_cache.device)
        samples.append((n, time.perf_counter() - start))
    ns = np.asarray([n for n, _ in samples], dtype=float)
    ts = np.asarray([t for _, t in samples])
    if np.ptp(ns) == 0:
        return SwapCostModel(per_block_s=float(ts.mean() / ns[0]))
    slope, intercept = np.polyfit(ns, ts, 1)
    return SwapCostModel(per_block_s=max(float(slope), 0.0), fixed_s=max(float(intercept), 0.0))


def make_kv_tiers(
    config: EngineConfig,
    model_config: ModelConfig,
    model_runner: Any,
    tokenizer: Any,
    folder: Path,
    num_blocks: int,
) -> tuple[BlockManager | TieredBlockManager, HostKVCache | None]:
    """The block manager for ``config`` and the host tier's memory (``None`` without one)."""
    if not (config.enable_prefix_caching and config.enable_knowledge_tree):
        return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching), None
    host = None
    per_block = model_runner.kv_cache[:, :, 0].numel() * model_runner.kv_cache.element_size()
    num_host_blocks = config.host_kv_cache_bytes // per_block
    if config.host_kv_cache_bytes and num_host_blocks == 0:
        raise ValueError(
            f"host_kv_cache_bytes={config.host_kv_cache_bytes} holds no block of {per_block} bytes"
        )
    if num_host_blocks:
        host = HostKVCache(model_runner.kv_cache, num_host_blocks, overlap=config.overlap_swap_in)
    manager = TieredBlockManager(
        num_blocks,
        config.block_size,
        num_host_blocks=num_host_blocks,
        policy=config.kv_eviction_policy,
        cost_fn=PrefillCostModel.from_flops(model_config),
        newline_counts=whitespace_newline_counts(tokenizer, _tokenizer_digest(folder)),
    )
    return manager, host


def profile_prefill_cost(engine: Any, lengths: tuple[int, ...] = (64, 256)) -> PrefillCostModel:
    """Fit ``PrefillCostModel`` to the engine's measured prefill times: prompts of each length
    after no prefix and after a cached prefix of each length (an idle engine; it ends empty)."""
    import time

    from ragserve.generation.sampling_params import SamplingParams

    limit = engine.max_model_len - 2
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    samples = []
    for context in (0, *lengths):
        for n in lengths:
            if context + n > limit:
                continue
            prefix = rng.integers(3, min(engine.model_config.vocab_size, 30000), context + n)
            if context:
                engine.generate([prefix[:context].tolist() + [5]], params)
            start = time.perf_counter()
            engine.generate([prefix.tolist()], params)
            samples.append((n, context, time.perf_counter() - start))
    engine.block_manager.reset_prefix_cache()
    return PrefillCostModel.fit(samples)


def _tokenizer_digest(folder: Path) -> str | None:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    return hashlib.sha1(path.read_bytes()).hexdigest()


def kv_tier_stats(
    bm: BlockManager | TieredBlockManager, host: HostKVCache | None, hit_tokens: int
) -> dict[str, int]:
    """The tier counters of ``LLMEngine.stats()`` (zeros where a tier does not exist)."""
    if not isinstance(bm, TieredBlockManager):
        return {
            "num_gpu_hit_tokens": hit_tokens,
            "num_host_hit_tokens": 0,
            "num_swapped_out_blocks": 0,
            "num_swapped_in_blocks": 0,
            "num_swap_out_bytes": 0,
            "num_swap_in_bytes": 0,
            "num_evicted_gpu_blocks": 0,
            "num_evicted_host_blocks": 0,
            "num_swap_skipped_blocks": 0,
            "num_kv_tree_nodes": 0,
            "num_host_blocks_used": 0,
            "num_host_blocks_total": 0,
        }
    per_block = host.bytes_per_block if host is not None else 0
    return {
        "num_gpu_hit_tokens": bm.num_gpu_hit_tokens,
        "num_host_hit_tokens": bm.num_host_hit_tokens,
        "num_swapped_out_blocks": bm.num_swapped_out_blocks,
        "num_swapped_in_blocks": bm.num_swapped_in_blocks,
        "num_swap_out_bytes": bm.num_swapped_out_blocks * per_block,
        "num_swap_in_bytes": bm.num_swapped_in_blocks * per_block,
        "num_evicted_gpu_blocks": bm.num_evicted_gpu_blocks,
        "num_evicted_host_blocks": bm.num_evicted_host_blocks,
        "num_swap_skipped_blocks": bm.num_swap_skipped_blocks,
        "num_kv_tree_nodes": len(bm.nodes),
        "num_host_blocks_used": bm.num_host_used_blocks,
        "num_host_blocks_total": bm.num_host_blocks,
    }
