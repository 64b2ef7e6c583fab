"""Offline models of the GPU tier's policy (docs/tier_policy.md): measured scan grids
(``measure_profile``, ``measure_scan_grid``), the CPU latency model (``measure_cpu_model``),
``sigma_max^2`` from calibration probes (``profile_max_variance``), the paper's
``Hitrate2Coverage`` and Eq. 1 with the cold part streamed (``StreamedLatencyModel``).
The tier itself plans with ``retrieval.partition``."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.cold_stream import StreamCostModel
from ragserve.retrieval.hit_rate import BetaHitRate, check_tail_mode
from ragserve.retrieval.latency_model import LatencyModel, SearchLatencyModel, SearchProfile
from ragserve.retrieval.partition import access_share, count_accesses, hottest_first
from ragserve.retrieval.types import ScanIndex


def measure_profile(
    index: ScanIndex,
    queries: np.ndarray,
    *,
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64),
    cluster_counts: tuple[int, ...] | None = None,
    topk: int = 10,
    repeats: int = 3,
) -> SearchProfile:
    """Time ``index.scan`` over the grid; ``queries`` needs ``max(batch_sizes)`` rows."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if len(q) < max(batch_sizes):
        raise ValueError(f"need {max(batch_sizes)} queries, got {len(q)}")
    if cluster_counts is None:
        cluster_counts = tuple(
            sorted({c for c in (1, 4, 16, 64) if c <= index.nlist} | {index.nlist})
        )
    plan = index.assign(q[: max(batch_sizes)], max(cluster_counts))

    def run(b: int, c: int) -> None:
        index.scan(q[:b], plan.rows(0, b).columns(0, c), topk)

    return measure_scan_grid(run, batch_sizes, cluster_counts, repeats=repeats, warmup=0, topk=topk)


def measure_scan_grid(
    run: Callable[[int, int], object],
    batch_sizes: Sequence[int],
    cluster_counts: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    synchronize: Callable[[], object] | None = None,
    topk: int = 10,
) -> SearchProfile:
    """Median seconds of ``run(batch_size, clusters_per_query)`` (after ``warmup`` calls) over
    the grid; ``synchronize`` (e.g. ``torch.cuda.synchronize``) makes each cover device work."""
    for grid in (batch_sizes, cluster_counts):
        if not grid or min(grid) < 1 or list(grid) != sorted(set(grid)):
            raise ValueError(
                "batch_sizes and cluster_counts must be non-empty, >= 1, strictly ascending"
            )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    sync = synchronize or (lambda: None)

    def median(b: int, c: int) -> float:
        for _ in range(warmup):
            run(b, c)
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(b, c)
            sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    seconds = tuple(tuple(median(b, c) for c in cluster_counts) for b in batch_sizes)
    return SearchProfile(tuple(batch_sizes), tuple(cluster_counts), seconds, topk)


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


def model_from_profile(
    profile: SearchProfile,
    nprobe: int,
    cq_seconds: Sequence[float] | np.ndarray,
    *,
    max_segments: int = 4,
) -> SearchLatencyModel:
    """``T_LUT`` from ``profile`` at ``nprobe`` clusters/query, ``T_CQ`` from ``cq_seconds``
    (one per ``profile.batch_sizes``)."""
    lut = [profile.predict(b, nprobe) for b in profile.batch_sizes]
    if len(cq_seconds) != len(profile.batch_sizes):
        raise ValueError(
            f"cq_seconds needs one value per profile batch size "
            f"({len(profile.batch_sizes)}), got {len(cq_seconds)}"
        )
    return SearchLatencyModel.fit(
        nprobe, profile.batch_sizes, cq_seconds, lut, max_segments=max_segments
    )


def fit_beta(hit_rates: np.ndarray) -> BetaHitRate:
    """``BetaHitRate`` by the method of moments; a variance past the Beta limit is clamped just
    below it."""
    x = np.asarray(hit_rates, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("hit_rates must be non-empty")
    if np.any(~np.isfinite(x)) or x.min() < 0 or x.max() > 1:
        raise ValueError("hit_rates must be finite and in [0, 1]")
    mean = float(x.mean())
    var = float(x.var(ddof=1)) if x.size > 1 else 0.0
    limit = mean * (1.0 - mean)
    if limit <= 0.0 or var <= 1e-15:
        return BetaHitRate(mean, 0.0)
    return BetaHitRate(mean, min(var, limit * (1.0 - 1e-6)))


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


@dataclass(frozen=True)
class StreamedLatencyModel(LatencyModel):
    """Eq. 1 with cold lists streamed (docs/tier_policy.md), with ``SearchLatencyModel``'s
    interface. ``cost``'s stream side prices the stream; with ``rows_per_probe`` (rows of a
    cold probe) its CPU side is the router's pricing, which sets the split, else the router
    prices the CPU at ``T_LUT`` (the balanced split). ``bytes_per_probe``: mean bytes of a
    cold list per probe; ``distinct_share``: share of a batch's cold probes whose list is not
    already streamed for another of its queries (1: the conservative default)."""

    base: SearchLatencyModel
    cost: StreamCostModel
    bytes_per_probe: float
    distinct_share: float = 1.0
    rows_per_probe: float | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_probe < 0 or not 0.0 < self.distinct_share <= 1.0:
            raise ValueError(
                f"bytes_per_probe must be >= 0 and distinct_share in (0, 1], got "
                f"{self.bytes_per_probe} and {self.distinct_share}"
            )

    @property
    def nprobe(self) -> int:
        return self.base.nprobe

    def cq_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        return self.base.cq_array(batch_sizes)

    def lut_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        return self.base.lut_array(batch_sizes)

    def router_seconds(self, batch_sizes: np.ndarray) -> tuple[np.ndarray, float]:
        """``(L_r(b), c0)``: the router's CPU seconds for all probes of ``b`` and its fixed
        cost (balanced: ``T_LUT(b)`` and 0)."""
        b = np.maximum(np.asarray(batch_sizes, dtype=np.float64), 1.0)
        if self.rows_per_probe is None:
            return self.lut_array(b), 0.0
        rows = b * self.base.nprobe * self.rows_per_probe
        c = self.cost
        return c.cpu_s_per_row * rows / np.minimum(b, float(c.threads)), c.cpu_fixed_s

    def streamed_shares(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        """``y``: the share of a batch's probes the router streams when a share ``cold`` of
        them is not resident, ``clip((c0 + L_r m - s0) / (g + L_r), 0, m)``."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        m = np.asarray(cold, dtype=np.float64)
        lut_r, c0 = self.router_seconds(b)
        g, s0 = self._stream_array(b), self.cost.stream_fixed_s
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(g + lut_r > 0, (c0 + lut_r * m - s0) / (g + lut_r), 0.0)
        return np.clip(y, 0.0, m)

    def cold_array(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        """The later of the two sides' seconds, each at its real pace."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        m = np.asarray(cold, dtype=np.float64)
        y = self.streamed_shares(b, m)
        stream = np.where(y > 0, self.cost.stream_fixed_s + self._stream_array(b) * y, 0.0)
        return np.maximum(stream, self.lut_array(b) * (m - y))

    def _stream_array(self, b: np.ndarray) -> np.ndarray:
        """``g(b)``: seconds (beyond the fixed cost) to stream every probe of a batch."""
        per_probe = self.bytes_per_probe * self.distinct_share * self.cost.stream_s_per_byte
        return np.maximum(b, 1.0) * self.base.nprobe * per_probe

    def required_hit_rates(self, batch_sizes: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Vectorised; ``inf`` marks the infeasible entries. The cold time is non-decreasing
        in ``m``, so the largest ``m`` within budget is bisected (60 halvings)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        left = np.asarray(seconds, dtype=np.float64) - self.cq_array(b)
        b, left = np.broadcast_arrays(b, left)
        lo, hi = np.zeros(b.shape), np.ones(b.shape)
        fits_all = self.cold_array(b, hi) <= left
        for _ in range(60):
            mid = (lo + hi) / 2
            ok = self.cold_array(b, mid) <= left
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
        return np.where(left < 0, np.inf, 1.0 - np.where(fits_all, 1.0, lo))
