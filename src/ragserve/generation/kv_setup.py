"""Builds the engine's KV tiers from its config, and reports their counters.

``make_kv_tiers`` picks the manager: the knowledge tree (``TieredBlockManager``, the default)
or the plain hashed-block prefix cache (``BlockManager``, ``enable_knowledge_tree=False`` or
prefix caching off), sizes the host tier from ``host_kv_cache_bytes`` and sets PGDSF's
prefill-cost model (``PrefillCostModel``: FLOP-derived until ``LLMEngine.profile_prefill_cost``
replaces it with measured times).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragserve.generation.block_manager import BlockManager
from ragserve.generation.config import EngineConfig, ModelConfig
from ragserve.generation.kv_cache_manager import TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache
from ragserve.generation.segments import whitespace_newline_counts

logger = logging.getLogger(__name__)


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
    def from_flops(cls, cfg: ModelConfig, seconds_per_flop: float = 1e-12) -> PrefillCostModel:
        """Costs from the model's shape (2 FLOPs per weight, 4 per attended key) at
        ``seconds_per_flop`` (the default, 1 TFLOP/s, gives relative costs only)."""
        weights = cfg.num_hidden_layers * (
            cfg.hidden_size
            * cfg.head_dim
            * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        return cls(
            per_token_s=2.0 * weights * seconds_per_flop,
            per_token_context_s=attention * seconds_per_flop,
        )

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]]) -> PrefillCostModel:
        """Least squares with non-negative coefficients over measured ``(num_tokens,
        num_context_tokens, seconds)`` (exact: the best of the 8 active sets of 3 terms)."""
        if len(samples) < 3:
            raise ValueError("samples: at least 3 measurements are needed to fit the model")
        rows = np.asarray([(1.0, n, n * (c + n / 2)) for n, c, _ in samples], dtype=float)
        times = np.asarray([s for *_, s in samples], dtype=float)
        scale = np.abs(rows).max(axis=0)
        scale[scale == 0] = 1.0
        best, best_err = np.zeros(3), float(np.sum(times**2))
        for mask in range(1, 8):
            cols = [i for i in range(3) if mask >> i & 1]
            coef, *_ = np.linalg.lstsq(rows[:, cols] / scale[cols], times, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[cols] = coef / scale[cols]
            err = float(np.sum((rows @ full - times) ** 2))
            if err < best_err:
                best, best_err = full, err
        fixed, per_token, per_ctx = (float(x) for x in best)
        return cls(per_token_s=per_token, per_token_context_s=per_ctx, fixed_s=fixed)

    def rejection(self, num_tokens: int) -> str | None:
        """Why this fitted model cannot price recompute (``None``: it can). Rejected: no cost
        per token (recompute would look free), or the fixed cost at least half of the
        prediction for ``num_tokens`` new tokens (the longest profiled prompt): then the
        timings measured overhead, not prefill."""
        if self.per_token_s <= 0.0:
            return "per-token cost is 0"
        if self.fixed_s >= 0.5 * self(num_tokens, 0):
            return f"the fixed cost dominates ({self.fixed_s:.3g} s of {self(num_tokens, 0):.3g} s)"
        return None


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

    host.run([SwapOp("in", 0, 0)])  # warm-up, untimed
    host.synchronize()
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
        host = HostKVCache(
            model_runner.kv_cache,
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


def profile_prefill_cost(
    engine: Any,
    lengths: tuple[int, ...] = (64, 128, 256),
    repeats: int = 2,
    clock: Callable[[], float] | None = None,
) -> PrefillCostModel:
    """Fit ``PrefillCostModel`` to the engine's measured prefill times (an idle engine; it
    ends empty): one untimed warm-up prompt of each length first (lazy initialisation, kernel
    selection), then prompts of each length after no prefix and after a cached prefix of
    each length, the fastest of ``repeats`` runs each. The non-negative least-squares fit is
    used unless ``PrefillCostModel.rejection`` rejects it; then (logged) the fallback is the
    FLOP model scaled to the measured seconds per FLOP of the longest prompts without prefix
    (``fallback_prefill_cost``). ``clock``: seconds (``time.perf_counter``; tests fake it)."""
    import time

    from ragserve.generation.sampling_params import SamplingParams

    if not lengths or any(n < 1 for n in lengths) or repeats < 1:
        raise ValueError(f"lengths: need positive prompt lengths and repeats >= 1, got {lengths}")
    limit = engine.max_model_len - 2
    lengths = tuple(sorted({min(n, limit) for n in lengths}))
    clock = clock or time.perf_counter
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    high = min(engine.model_config.vocab_size, 30000)
    for n in lengths:  # warm-up, untimed
        engine.generate([rng.integers(3, high, n).tolist()], params)
    engine.block_manager.reset_prefix_cache()
    samples = []
    for context in (0, *lengths):
        for n in lengths:
            if context + n > limit:
                continue
            best = None
            for _ in range(repeats):
                prefix = rng.integers(3, high, context + n).tolist()
                if context:
                    engine.generate([prefix[:context] + [5]], params)
                start = clock()
                engine.generate([prefix], params)
                elapsed = clock() - start
                best = elapsed if best is None else min(best, elapsed)
            samples.append((n, context, best))
    engine.block_manager.reset_prefix_cache()
    model = PrefillCostModel.fit(samples)
    reason = model.rejection(max(lengths))
    if reason is None:
        return model
    fallback = fallback_prefill_cost(engine.model_config, samples)
    logger.warning("prefill-cost profile %s rejected (%s); using %s", model, reason, fallback)
    return fallback


def fallback_prefill_cost(
    cfg: ModelConfig, samples: list[tuple[int, int, float]]
) -> PrefillCostModel:
    """The FLOP model at the seconds per FLOP measured on the longest prompts without a
    cached prefix (the median; their time is the least dominated by per-call overhead)."""
    longest = max(n for n, c, _ in samples if c == 0)
    unit = PrefillCostModel.from_flops(cfg)  # at 1e-12 s per FLOP
    ratios = [s / unit(n, 0) * 1e-12 for n, c, s in samples if c == 0 and n == longest]
    return PrefillCostModel.from_flops(cfg, seconds_per_flop=float(np.median(ratios)))


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
            "num_swap_copies": 0,
            "num_evicted_gpu_blocks": 0,
            "num_evicted_host_blocks": 0,
            "num_swap_skipped_blocks": 0,
            "num_swap_out_skipped_blocks": 0,
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
        "num_swap_copies": host.num_copies if host is not None else 0,
        "num_evicted_gpu_blocks": bm.num_evicted_gpu_blocks,
        "num_evicted_host_blocks": bm.num_evicted_host_blocks,
        "num_swap_skipped_blocks": bm.num_swap_skipped_blocks,
        "num_swap_out_skipped_blocks": bm.num_swap_out_skipped_blocks,
        "num_kv_tree_nodes": len(bm.nodes),
        "num_host_blocks_used": bm.num_host_used_blocks,
        "num_host_blocks_total": bm.num_host_blocks,
    }
