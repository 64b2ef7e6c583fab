"""Offline calibration of the GPU tier's policy inputs (docs/tier_policy.md): the CPU latency
model (``measure_cpu_model``), ``sigma_max^2`` from calibration probes (``profile_max_variance``)
and the paper's ``Hitrate2Coverage``. The tier itself plans with ``retrieval.partition``."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import numpy as np

from ragserve.retrieval.hit_rate import BetaHitRate, check_tail_mode
from ragserve.retrieval.latency_model import SearchLatencyModel
from ragserve.retrieval.partition import access_share, count_accesses, hottest_first
from ragserve.retrieval.types import ScanIndex


def measure_cpu_model(
    index: ScanIndex,
    queries: np.ndarray,
    nprobe: int,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    topk: int = 10,
    repeats: int = 3,
    max_segments: int = 4,
) -> SearchLatencyModel:
    """Fit the model to the medians of ``repeats`` timings of ``index.assign`` (CQ) and
    ``index.scan`` (LUT) per batch size (``queries`` needs ``max(batch_sizes)`` rows)."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be non-empty and >= 1, got {batch_sizes}")
    if len(q) < max(batch_sizes):
        raise ValueError(f"need {max(batch_sizes)} queries, got {len(q)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cq, lut = [], []
    for b in batch_sizes:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = index.assign(q[:b], nprobe)
            t1 = time.perf_counter()
            index.scan(q[:b], plan, topk)
            times.append((t1 - t0, time.perf_counter() - t1))
        cq_t, lut_t = np.median(np.array(times), axis=0)
        cq.append(float(cq_t))
        lut.append(float(lut_t))
    return SearchLatencyModel.fit(nprobe, batch_sizes, cq, lut, max_segments=max_segments)


def per_query_hit_rates(probe_ids: np.ndarray, on_gpu: np.ndarray) -> np.ndarray:
    """Each query's share of valid probes on the GPU (queries without one are dropped)."""
    ids = np.asarray(probe_ids)
    mask = np.asarray(on_gpu, dtype=bool)
    if ids.ndim != 2:
        raise ValueError(f"probe_ids must be [n, nprobe], got shape {ids.shape}")
    valid = ids >= 0
    hits = (mask[np.where(valid, ids, 0)] & valid).sum(axis=1)
    num = valid.sum(axis=1)
    keep = num > 0
    return hits[keep] / num[keep]


def profile_max_variance(probe_ids: np.ndarray, nlist: int) -> float:
    """``sigma_max^2``: per-query hit-rate variances at hottest-first coverages of mean hit
    rate near 0.1 .. 0.9, least-squares fitted to ``var = 4 sigma_max^2 mean (1 - mean)``."""
    counts = count_accesses(probe_ids, nlist)
    if counts.sum() == 0:
        raise ValueError("probe_ids has no valid probe")
    order = hottest_first(counts)
    share = access_share(counts, order)
    ks = np.unique(np.searchsorted(share, np.linspace(0.1, 0.9, 9)).clip(1, nlist))
    num = den = 0.0
    for k in ks:
        on_gpu = np.zeros(nlist, dtype=bool)
        on_gpu[order[:k]] = True
        rates = per_query_hit_rates(probe_ids, on_gpu)
        g = 4.0 * rates.mean() * (1.0 - rates.mean())
        num += g * rates.var()
        den += g * g
    if den == 0.0:
        return 0.0
    return float(min(num / den, 0.25 * (1.0 - 1e-6)))


def hit_rate_to_coverage(
    access_counts: np.ndarray,
    max_variance: float,
    tail_hit_rate: float,
    batch_size: int,
    *,
    tail_mode: str = "batch_mean",
    tail_quantile: float = 0.1,
) -> int | None:
    """``Hitrate2Coverage``: the fewest hottest clusters whose tail hit rate reaches
    ``tail_hit_rate``; None if not even all do."""
    order = hottest_first(access_counts)
    share = access_share(np.asarray(access_counts, dtype=np.float64), order)
    check_tail_mode(tail_mode, tail_quantile)

    def reaches(k: int) -> bool:
        dist = BetaHitRate.from_mean(float(share[k]), max_variance)
        return dist.tail(batch_size, tail_mode, tail_quantile) >= tail_hit_rate

    k = bisect.bisect_left(range(len(share)), True, key=reaches)
    return None if k == len(share) else k
