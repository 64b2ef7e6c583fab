"""HedraRAG Eq. 2's ``T_R`` modelled, not measured: retrieval throughput by GPU-tier bytes from
VectorLiteRAG's latency model, so Eq. 2 (``ragserve.runtime.memory_plan``) needs no retrieval
run per tier size (``bench_tier_overflow.py``'s budget phase)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ragserve.retrieval.latency_model import SearchLatencyModel
from ragserve.retrieval.partition import BetaHitRate, fill_budget
from ragserve.runtime.memory_plan import ThroughputProfile


def modelled_retrieval_profile(
    model: SearchLatencyModel,
    access_counts: np.ndarray,
    cluster_bytes: np.ndarray,
    max_variance: float,
    tier_sizes: Sequence[int],
    *,
    batch_size: int,
    retrievals_per_request: float = 1.0,
    tail_mode: str = "batch_mean",
    tail_quantile: float = 0.1,
) -> ThroughputProfile:
    """``T_R`` by tier bytes from the latency model: the hottest clusters that fit give a hit
    rate, ``BetaHitRate.tail`` its tail over ``batch_size`` queries (``tail_mode``), Eq. 1
    the batch's seconds."""
    sizes = sorted({int(s) for s in tier_sizes})
    if not sizes or sizes[0] < 0:
        raise ValueError(f"tier_sizes must be non-empty and >= 0, got {tier_sizes}")
    seconds = []
    for size in sizes:
        plan = fill_budget(access_counts, cluster_bytes, size)
        dist = BetaHitRate.from_mean(plan.hit_rate, max_variance)
        tail = dist.tail(batch_size, tail_mode, tail_quantile)
        seconds.append(model.hybrid_seconds(batch_size, tail))
    if min(seconds) <= 0:
        raise ValueError("the latency model predicts a zero-second batch: cannot give a rate")
    return ThroughputProfile.from_batch_latency(sizes, seconds, batch_size, retrievals_per_request)
