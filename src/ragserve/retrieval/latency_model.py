"""VectorLiteRAG §V-A: piecewise-linear latency models of IVF search and the hybrid Eq. 1,
``tau_s(b) = T_CQ(b) + (1 - eta) * T_LUT(b)`` (``SearchLatencyModel``), and Eq. 1 with cold
lists streamed to the GPU (``StreamedLatencyModel``). The formulas, the router's split and
why it is priced as it is: docs/tier_policy.md. Immutable models; pure NumPy (measurements
come in as arrays, through ``measure_cpu_model`` or ``measure_scan_grid``).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.profile import (  # noqa: F401 - two of them re-exported
    PiecewiseLinear,
    SearchProfile,
    measure_scan_grid,
)
from ragserve.retrieval.storage import JsonFile
from ragserve.retrieval.types import ScanIndex

# NOTE: past this many breakpoint combinations the candidates are thinned to quantiles of x.
_MAX_COMBINATIONS = 20_000


def fit_piecewise_linear(
    x: Sequence[float] | np.ndarray,
    y: Sequence[float] | np.ndarray,
    *,
    num_segments: int | None = None,
    max_segments: int = 4,
) -> PiecewiseLinear:
    """Least-squares continuous piecewise-linear fit of ``y`` against ``x``.

    Breakpoints are chosen among the distinct interior ``x`` values (exhaustively; thinned to
    quantiles when there are too many); residuals are relative (weights ``1 / |y|``), as timing
    noise is multiplicative. ``num_segments=None`` picks the count in ``1..max_segments`` by
    BIC (a breakpoint costs two parameters, location and slope change), so noise-free data
    from ``k`` segments gets exactly ``k``. Knots: ``[min(x), breakpoints..., max(x)]``.
    """
    xs, ys = _check_xy(x, y)
    distinct = np.unique(xs)
    if num_segments is not None and num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    counts = [num_segments] if num_segments is not None else range(1, max_segments + 1)
    candidates = _thin(distinct[1:-1], max(counts) - 1)
    w = _relative_weights(ys)
    floor = 1e-18  # NOTE: a relative SSE below this is rounding: exact data gets fewest segments
    best: tuple[float, tuple[float, ...]] | None = None
    for k in counts:
        if k - 1 > len(candidates):
            if num_segments is not None:
                raise ValueError(
                    f"num_segments={k} needs {k + 1} distinct x values, got {len(distinct)}"
                )
            break
        sse, breaks = _best_breaks(xs, ys, w, candidates, k - 1)
        n = len(xs)
        score = n * math.log(max(sse / n, floor)) + (3 * k - 1) * math.log(n)
        if best is None or score < best[0]:
            best = (score, breaks)
    assert best is not None
    knots = np.concatenate([[distinct[0]], best[1], [distinct[-1]]])
    coef = _lstsq(xs, ys, best[1], w)[1]
    values = _hinge_basis(knots, best[1]) @ coef
    return PiecewiseLinear(tuple(float(k) for k in knots), tuple(float(v) for v in values))


def _check_xy(x, y) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.ndim != 1 or xs.shape != ys.shape:
        raise ValueError(f"x and y must be 1-D of equal length, got {xs.shape} and {ys.shape}")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise ValueError("x and y must be finite")
    if len(np.unique(xs)) < 2:
        raise ValueError("x needs at least 2 distinct values")
    return xs, ys


def _thin(candidates: np.ndarray, num_breaks: int) -> np.ndarray:
    if num_breaks <= 0 or math.comb(len(candidates), num_breaks) <= _MAX_COMBINATIONS:
        return candidates
    size = len(candidates)
    while size > num_breaks and math.comb(size, num_breaks) > _MAX_COMBINATIONS:
        size -= 1
    return np.unique(np.quantile(candidates, np.linspace(0, 1, size), method="nearest"))


def _hinge_basis(x: np.ndarray, breaks: Sequence[float]) -> np.ndarray:
    cols = [np.ones_like(x), x] + [np.maximum(0.0, x - b) for b in breaks]
    return np.stack(cols, axis=1)


def _relative_weights(y: np.ndarray) -> np.ndarray:
    """``1 / |y|`` (floored): timing noise is multiplicative, so fit relative residuals."""
    top = float(np.abs(y).max())
    return 1.0 / np.maximum(np.abs(y), 1e-3 * top if top > 0 else 1.0)


def _lstsq(
    x: np.ndarray, y: np.ndarray, breaks: Sequence[float], w: np.ndarray
) -> tuple[float, np.ndarray]:
    a = _hinge_basis(x, breaks)
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    return float((((a @ coef - y) * w) ** 2).sum()), coef


def _best_breaks(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, candidates: np.ndarray, num_breaks: int
) -> tuple[float, tuple[float, ...]]:
    best: tuple[float, tuple[float, ...]] | None = None
    for breaks in itertools.combinations(candidates.tolist(), num_breaks):
        sse = _lstsq(x, y, breaks, w)[0]
        if best is None or sse < best[0] - 1e-15:
            best = (sse, tuple(breaks))
    assert best is not None
    return best


class _Eq1:
    """What both latency models derive from their ``cq_array``, ``lut_array``, ``cold_array``
    (seconds of a batch's non-resident share ``m``) and ``required_hit_rates``: the scalar
    forms and Eq. 1."""

    def cq_seconds(self, batch_size: float) -> float:
        """``T_CQ(b)``: coarse quantization of ``b`` queries, seconds."""
        return float(self.cq_array(np.asarray([batch_size]))[0])

    def lut_seconds(self, batch_size: float) -> float:
        """``T_LUT(b)``: scan of all ``nprobe`` lists of ``b`` queries on the CPU, seconds."""
        return float(self.lut_array(np.asarray([batch_size]))[0])

    def cpu_seconds(self, batch_size: float) -> float:
        """``T_search(b) = T_CQ(b) + T_LUT(b)``: the batch with nothing on the GPU."""
        return self.cq_seconds(batch_size) + self.lut_seconds(batch_size)

    def hybrid_seconds(self, batch_size: float, tail_hit_rate: float) -> float:
        """Eq. 1 for the batch's tail hit rate ``eta``: ``T_CQ(b) + (1 - eta) T_LUT(b)``
        (streamed: the later of the cold part's two sides, module doc)."""
        if not 0.0 <= tail_hit_rate <= 1.0:
            raise ValueError(f"tail_hit_rate must be in [0, 1], got {tail_hit_rate}")
        b = np.asarray([batch_size], dtype=np.float64)
        cold = float(self.cold_array(b, np.asarray([1.0 - tail_hit_rate]))[0])
        return self.cq_seconds(batch_size) + cold

    def required_hit_rate(self, batch_size: float, seconds: float) -> float | None:
        """Eq. 1 inverted: the smallest tail hit rate in ``[0, 1]`` that keeps a batch of
        ``batch_size`` within ``seconds``; ``None`` when even an all-GPU scan is too slow."""
        eta = float(self.required_hit_rates(np.asarray([batch_size]), np.asarray([seconds]))[0])
        return None if math.isinf(eta) else eta


@dataclass(frozen=True)
class SearchLatencyModel(JsonFile, _Eq1):
    """VectorLiteRAG's CPU search model at one ``nprobe``: ``T_CQ(b)``, ``T_LUT(b)`` (seconds).

    Predictions are the non-decreasing envelope over batch sizes ``1..b`` of the fitted
    functions, clamped at zero. NOTE: the envelope (a batch is never predicted faster than a
    smaller one) makes the partitioner's feasibility monotone in coverage, so Algorithm 1's
    bisection finds the smallest feasible coverage exactly.
    """

    nprobe: int
    cq: PiecewiseLinear
    lut: PiecewiseLinear

    def __post_init__(self) -> None:
        if self.nprobe < 1:
            raise ValueError(f"nprobe must be >= 1, got {self.nprobe}")

    @classmethod
    def fit(
        cls,
        nprobe: int,
        batch_sizes: Sequence[int] | np.ndarray,
        cq_seconds: Sequence[float] | np.ndarray,
        lut_seconds: Sequence[float] | np.ndarray,
        *,
        max_segments: int = 4,
    ) -> SearchLatencyModel:
        """Fit both stages from measurements (one entry per measured batch, repeats allowed)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        if b.size and b.min() < 1:
            raise ValueError(f"batch_sizes must be >= 1, got min {b.min()}")
        for name, s in (("cq_seconds", cq_seconds), ("lut_seconds", lut_seconds)):
            if np.any(np.asarray(s, dtype=np.float64) < 0):
                raise ValueError(f"{name} must be >= 0")
        cq = fit_piecewise_linear(b, cq_seconds, max_segments=max_segments)
        lut = fit_piecewise_linear(b, lut_seconds, max_segments=max_segments)
        return cls(nprobe, cq, lut)

    @classmethod
    def from_profile(
        cls,
        profile: SearchProfile,
        nprobe: int,
        cq_seconds: Sequence[float] | np.ndarray,
        *,
        max_segments: int = 4,
    ) -> SearchLatencyModel:
        """``T_LUT`` from a measured ``SearchProfile`` at ``nprobe`` clusters/query (its
        interpolation over cluster counts), ``T_CQ`` from ``cq_seconds`` (one per
        ``profile.batch_sizes``)."""
        lut = [profile.predict(b, nprobe) for b in profile.batch_sizes]
        if len(cq_seconds) != len(profile.batch_sizes):
            raise ValueError(
                f"cq_seconds needs one value per profile batch size "
                f"({len(profile.batch_sizes)}), got {len(cq_seconds)}"
            )
        return cls.fit(nprobe, profile.batch_sizes, cq_seconds, lut, max_segments=max_segments)

    def cold_array(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        """Seconds of the cold share ``cold`` of every probe, on the CPU: ``m T_LUT(b)``."""
        return self.lut_array(batch_sizes) * cold

    def required_hit_rates(self, batch_sizes: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Vectorised ``required_hit_rate``; ``inf`` marks the infeasible entries."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        cq, lut = self.cq_array(b), self.lut_array(b)
        budget = np.asarray(seconds, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            eta = np.where(lut > 0, (cq + lut - budget) / lut, 0.0)
        eta = np.clip(eta, 0.0, None)
        return np.where((cq > budget) | (eta > 1.0), np.inf, eta)

    def cq_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        """``T_CQ`` at every batch size (seconds)."""
        return _envelope(self.cq, batch_sizes)

    def lut_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        """``T_LUT`` at every batch size (seconds)."""
        return _envelope(self.lut, batch_sizes)

    @classmethod
    def from_json(cls, text: str) -> SearchLatencyModel:
        raw = json.loads(text)
        try:
            cq, lut = raw["cq"], raw["lut"]
            return cls(
                int(raw["nprobe"]),
                PiecewiseLinear(tuple(cq["knots"]), tuple(cq["values"])),
                PiecewiseLinear(tuple(lut["knots"]), tuple(lut["values"])),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a SearchLatencyModel: missing or bad field {e}") from e


@dataclass(frozen=True)
class StreamModel:
    """Seconds to stream and scan cold lists on the GPU: ``fixed_s + s_per_byte * bytes``
    (``cold_stream.StreamCostModel``'s stream side)."""

    fixed_s: float
    s_per_byte: float

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.s_per_byte < 0:
            raise ValueError(f"fixed_s and s_per_byte must be >= 0, got {self}")


@dataclass(frozen=True)
class SplitPricing:
    """How the router prices the CPU's share when it splits a batch's cold probes (the CPU
    side of ``cold_stream.StreamCostModel``): ``cpu_fixed_s + cpu_s_per_row * rows / min(b,
    threads)`` for ``rows`` probed rows, a cold probe being ``rows_per_probe`` rows. The split
    it picks with this pricing is the one that runs, whatever the CPU's real pace."""

    cpu_fixed_s: float
    cpu_s_per_row: float
    threads: int
    rows_per_probe: float

    def __post_init__(self) -> None:
        if min(self.cpu_fixed_s, self.cpu_s_per_row, self.rows_per_probe) < 0 or self.threads < 1:
            raise ValueError(f"SplitPricing needs non-negative terms and threads >= 1, got {self}")

    def lut_array(self, batch_sizes: np.ndarray, nprobe: int) -> np.ndarray:
        """``L_r(b)``: the router's seconds (beyond ``cpu_fixed_s``) for all probes of ``b``."""
        b = np.maximum(np.asarray(batch_sizes, dtype=np.float64), 1.0)
        rows = b * nprobe * self.rows_per_probe
        return self.cpu_s_per_row * rows / np.minimum(b, float(self.threads))


@dataclass(frozen=True)
class StreamedLatencyModel(_Eq1):
    """Eq. 1 with cold lists streamed (module doc): ``SearchLatencyModel``'s interface, so
    Algorithm 1 (``partition``) and Eq. 2 (``memory_split``) price the streamed path.

    ``bytes_per_probe``: mean bytes of a cold list per probe (access-weighted);
    ``distinct_share``: share of a batch's cold probes whose list is not already streamed for
    another query of the batch (1: no sharing, the conservative default); ``split``: the
    router's pricing of the CPU, which sets the split (None: ``T_LUT``'s, the balanced split)."""

    base: SearchLatencyModel
    stream: StreamModel
    bytes_per_probe: float
    distinct_share: float = 1.0
    split: SplitPricing | None = None

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

    def stream_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        """``g(b)``: seconds (beyond ``fixed_s``) to stream every probe of a batch."""
        b = np.maximum(np.asarray(batch_sizes, dtype=np.float64), 1.0)
        per_probe = self.bytes_per_probe * self.distinct_share * self.stream.s_per_byte
        return b * self.base.nprobe * per_probe

    def streamed_shares(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        """``y``: the share of a batch's probes the router streams when a share ``cold`` of
        them is not resident (module doc), elementwise."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        m = np.asarray(cold, dtype=np.float64)
        lut_r, c0 = self._router(b)
        g, s0 = self.stream_array(b), self.stream.fixed_s
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(g + lut_r > 0, (c0 + lut_r * m - s0) / (g + lut_r), 0.0)
        return np.clip(y, 0.0, m)

    def cold_array(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        """Seconds of the cold part (both sides, the later one), elementwise."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        m = np.asarray(cold, dtype=np.float64)
        y = self.streamed_shares(b, m)
        stream = np.where(y > 0, self.stream.fixed_s + self.stream_array(b) * y, 0.0)
        return np.maximum(stream, self.lut_array(b) * (m - y))

    def _router(self, b: np.ndarray) -> tuple[np.ndarray, float]:
        if self.split is None:
            return self.lut_array(b), 0.0
        return self.split.lut_array(b, self.base.nprobe), self.split.cpu_fixed_s

    def required_hit_rates(self, batch_sizes: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Vectorised; ``inf`` marks the infeasible entries. The cold time is non-decreasing
        in ``m`` (both sides' shares grow with it), so the largest ``m`` within budget is found
        by bisection (60 halvings of ``[0, 1]``)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        left = np.asarray(seconds, dtype=np.float64) - self.cq_array(b)
        b, left = np.broadcast_arrays(b, left)
        lo, hi = np.zeros(b.shape), np.ones(b.shape)
        fits_all = self.cold_array(b, hi) <= left
        for _ in range(60):
            mid = (lo + hi) / 2
            ok = self.cold_array(b, mid) <= left
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
        m = np.where(fits_all, 1.0, lo)
        return np.where(left < 0, np.inf, 1.0 - m)


LatencyModel = SearchLatencyModel | StreamedLatencyModel  # what Algorithm 1 and Eq. 2 price


def _envelope(f: PiecewiseLinear, batch_sizes: np.ndarray) -> np.ndarray:
    """``max(0, max over x in [1, b] of f(x))`` for every ``b`` (batch sizes ``>= 1``)."""
    b = np.maximum(np.asarray(batch_sizes, dtype=np.float64), 1.0)
    knots = np.asarray(f.knots)
    points = np.concatenate([[1.0], knots[knots > 1.0]])
    at_points = np.maximum.accumulate(f.evaluate(points))
    idx = np.searchsorted(points, b, side="right") - 1
    return np.maximum(0.0, np.maximum(at_points[idx], f.evaluate(b)))


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
    """Time ``index.assign`` (CQ) and ``index.scan`` (LUT) per batch size and fit the model.

    ``queries`` needs ``max(batch_sizes)`` rows; each point is the median of ``repeats``.
    """
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be non-empty and >= 1, got {batch_sizes}")
    if len(q) < max(batch_sizes):
        raise ValueError(f"need {max(batch_sizes)} queries, got {len(q)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cq, lut = [], []
    for b in batch_sizes:
        sub = q[:b]
        cq_t, lut_t = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = index.assign(sub, nprobe)
            t1 = time.perf_counter()
            index.scan(sub, plan, topk)
            cq_t.append(t1 - t0)
            lut_t.append(time.perf_counter() - t1)
        cq.append(float(np.median(cq_t)))
        lut.append(float(np.median(lut_t)))
    return SearchLatencyModel.fit(nprobe, batch_sizes, cq, lut, max_segments=max_segments)
