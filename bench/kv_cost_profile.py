"""The measured cost models of the knowledge tree, used by ``bench_kv_reuse.py``: PGDSF's
prefill cost (``PrefillCostModel``, timed on the engine after a warm-up and fitted by
non-negative least squares, or the FLOP model scaled to the measured time when the fit
prices recompute as free or as fixed overhead) and the host tier's swap-in cost
(``SwapCostModel``: host hits are then swapped in only where that beats recomputing them).
``profile_kv_costs(engine)`` measures both and sets them on an idle engine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ragserve.generation import LLMEngine, ModelConfig, SamplingParams
from ragserve.generation.kv_cache_manager import PrefillCostModel, SwapOp, TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache

logger = logging.getLogger(__name__)


def profile_kv_costs(
    engine: LLMEngine, lengths: tuple[int, ...] = (64, 128, 256)
) -> PrefillCostModel | None:
    """Measure and set the engine's prefill cost model (nodes created from now on use it) and,
    with a host tier, its swap cost; ``None`` without the knowledge tree. An idle engine: it
    adds and drops its own requests and empties the cache."""
    bm = engine.block_manager
    if not isinstance(bm, TieredBlockManager):
        return None
    bm.cost_fn = model = profile_prefill_cost(engine, lengths)
    if engine.host_kv_cache is not None:
        bm.swap_cost_fn = profile_swap_cost(engine.host_kv_cache, bm.num_blocks)
    return model


def fit_prefill_cost(samples: list[tuple[int, int, float]]) -> PrefillCostModel:
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
    return PrefillCostModel(per_token_s=per_token, per_token_context_s=per_ctx, fixed_s=fixed)


def rejection(model: PrefillCostModel, num_tokens: int) -> str | None:
    """Why this fitted model cannot price recompute (``None``: it can). Rejected: no cost
    per token (recompute would look free), or the fixed cost at least half of the
    prediction for ``num_tokens`` new tokens (the longest profiled prompt): then the
    timings measured overhead, not prefill."""
    if model.per_token_s <= 0.0:
        return "per-token cost is 0"
    if model.fixed_s >= 0.5 * model(num_tokens, 0):
        return f"the fixed cost dominates ({model.fixed_s:.3g} s of {model(num_tokens, 0):.3g} s)"
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
            torch.cuda.synchronize(host.gpu_cache.device)
        samples.append((n, time.perf_counter() - start))
    ns = np.asarray([n for n, _ in samples], dtype=float)
    ts = np.asarray([t for _, t in samples])
    if np.ptp(ns) == 0:
        return SwapCostModel(per_block_s=float(ts.mean() / ns[0]))
    slope, intercept = np.polyfit(ns, ts, 1)
    return SwapCostModel(per_block_s=max(float(slope), 0.0), fixed_s=max(float(intercept), 0.0))


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
    used unless ``rejection`` rejects it; then (logged) the fallback is the
    FLOP model scaled to the measured seconds per FLOP of the longest prompts without prefix
    (``fallback_prefill_cost``). ``clock``: seconds (``time.perf_counter``; tests fake it)."""
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
    model = fit_prefill_cost(samples)
    reason = rejection(model, max(lengths))
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
