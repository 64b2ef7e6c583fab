"""Predicting a scan's seconds (VectorLiteRAG §V-A): the measured ``SearchProfile`` (scan
seconds on a grid of batch sizes x clusters per query), piecewise-linear fits, and Eq. 1,
``tau_s(b) = T_CQ(b) + (1 - eta) T_LUT(b)`` (``SearchLatencyModel``). Formulas and why:
docs/tier_policy.md. Immutable models; pure NumPy.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.storage import JsonFile

_MAX_COMBINATIONS = 20_000  # NOTE: past this many breakpoint sets, candidates thin to quantiles


@dataclass(frozen=True)
class PiecewiseLinear:
    """Continuous, through ``(knots[i], values[i])`` (knots strictly ascending); the end
    segments extend past the ends (one knot: a constant)."""

    knots: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.knots) == 0 or len(self.knots) != len(self.values):
            raise ValueError(
                f"knots and values must be non-empty and of equal length, "
                f"got {len(self.knots)} and {len(self.values)}"
            )
        k = np.asarray(self.knots, dtype=np.float64)
        if not np.all(np.isfinite(k)) or not np.all(np.isfinite(self.values)):
            raise ValueError("knots and values must be finite")
        if np.any(np.diff(k) <= 0):
            raise ValueError(f"knots must be strictly ascending, got {self.knots}")

    @property
    def slopes(self) -> tuple[float, ...]:
        k, v = np.asarray(self.knots), np.asarray(self.values)
        return tuple(float(s) for s in np.diff(v) / np.diff(k))

    def __call__(self, x: float) -> float:
        return float(self.evaluate(np.asarray([x], dtype=np.float64))[0])

    def evaluate(self, x: np.ndarray) -> np.ndarray:
        xs = np.asarray(x, dtype=np.float64)
        k, v = np.asarray(self.knots), np.asarray(self.values)
        if len(k) == 1:
            return np.full(xs.shape, v[0])
        lo, hi = (v[1] - v[0]) / (k[1] - k[0]), (v[-1] - v[-2]) / (k[-1] - k[-2])
        out = np.where(xs < k[0], v[0] + lo * (xs - k[0]), np.interp(xs, k, v))
        return np.where(xs > k[-1], v[-1] + hi * (xs - k[-1]), out)


@dataclass(frozen=True)
class SearchProfile(JsonFile):
    """Measured scan seconds: ``seconds[i][j]`` for ``batch_sizes[i]`` queries x
    ``cluster_counts[j]`` clusters each."""

    batch_sizes: tuple[int, ...]
    cluster_counts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    topk: int = 10

    def predict(self, batch_size: float, clusters_per_query: float) -> float:
        """Bilinear interpolation (end segments extended), at least 0."""
        at = tuple(
            PiecewiseLinear(self.cluster_counts, r)(clusters_per_query) for r in self.seconds
        )
        return max(0.0, PiecewiseLinear(self.batch_sizes, at)(batch_size))

    @classmethod
    def from_json(cls, text: str) -> SearchProfile:
        raw = json.loads(text)
        return cls(
            tuple(raw["batch_sizes"]),
            tuple(raw["cluster_counts"]),
            tuple(tuple(r) for r in raw["seconds"]),
            raw.get("topk", 10),
        )


def fit_piecewise_linear(
    x: Sequence[float] | np.ndarray,
    y: Sequence[float] | np.ndarray,
    *,
    num_segments: int | None = None,
    max_segments: int = 4,
) -> PiecewiseLinear:
    """Least squares on relative residuals (timing noise is multiplicative), breakpoints among
    the distinct interior ``x``; ``num_segments=None`` picks ``1..max_segments`` by BIC, so
    noise-free data from ``k`` segments gets ``k``. Knots: ``[min(x), breaks..., max(x)]``."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.ndim != 1 or xs.shape != ys.shape:
        raise ValueError(f"x and y must be 1-D of equal length, got {xs.shape} and {ys.shape}")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise ValueError("x and y must be finite")
    distinct = np.unique(xs)
    if len(distinct) < 2:
        raise ValueError("x needs at least 2 distinct values")
    if num_segments is not None and num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    counts = [num_segments] if num_segments is not None else range(1, max_segments + 1)
    candidates = _thin(distinct[1:-1], max(counts) - 1)
    top = float(np.abs(ys).max())
    w = 1.0 / np.maximum(np.abs(ys), 1e-3 * top if top > 0 else 1.0)
    n, best = len(xs), None
    for k in counts:
        if k - 1 > len(candidates):
            if num_segments is not None:
                raise ValueError(
                    f"num_segments={k} needs {k + 1} distinct x values, got {len(distinct)}"
                )
            break
        sse, breaks = np.inf, ()
        for cand in itertools.combinations(candidates.tolist(), k - 1):
            err = _lstsq(xs, ys, cand, w)[0]
            if err < sse - 1e-15:
                sse, breaks = err, cand
        # NOTE: a relative SSE below 1e-18 is rounding: exact data gets the fewest segments
        score = n * math.log(max(sse / n, 1e-18)) + (3 * k - 1) * math.log(n)
        if best is None or score < best[0]:
            best = (score, breaks)
    knots = np.concatenate([[distinct[0]], best[1], [distinct[-1]]])
    values = _hinge_basis(knots, best[1]) @ _lstsq(xs, ys, best[1], w)[1]
    return PiecewiseLinear(tuple(float(k) for k in knots), tuple(float(v) for v in values))


def _thin(candidates: np.ndarray, num_breaks: int) -> np.ndarray:
    size = len(candidates)
    while size > num_breaks > 0 and math.comb(size, num_breaks) > _MAX_COMBINATIONS:
        size -= 1
    if size == len(candidates):
        return candidates
    return np.unique(np.quantile(candidates, np.linspace(0, 1, size), method="nearest"))


def _hinge_basis(x: np.ndarray, breaks: Sequence[float]) -> np.ndarray:
    return np.stack([np.ones_like(x), x] + [np.maximum(0.0, x - b) for b in breaks], axis=1)


def _lstsq(x, y, breaks: Sequence[float], w: np.ndarray) -> tuple[float, np.ndarray]:
    a = _hinge_basis(x, breaks)
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    return float((((a @ coef - y) * w) ** 2).sum()), coef


class LatencyModel:
    """What Algorithm 1 and Eq. 2 price a batch with: the scalar forms and Eq. 1 from a
    subclass's ``cq_array``, ``lut_array``, ``cold_array`` (seconds of a batch's non-resident
    share ``m``) and ``required_hit_rates``."""

    def cq_seconds(self, batch_size: float) -> float:
        return float(self.cq_array(np.asarray([batch_size]))[0])

    def lut_seconds(self, batch_size: float) -> float:
        return float(self.lut_array(np.asarray([batch_size]))[0])

    def cpu_seconds(self, batch_size: float) -> float:
        """``T_CQ(b) + T_LUT(b)``: the batch with nothing on the GPU."""
        return self.cq_seconds(batch_size) + self.lut_seconds(batch_size)

    def hybrid_seconds(self, batch_size: float, tail_hit_rate: float) -> float:
        """Eq. 1 at the batch's tail hit rate ``eta``."""
        if not 0.0 <= tail_hit_rate <= 1.0:
            raise ValueError(f"tail_hit_rate must be in [0, 1], got {tail_hit_rate}")
        b = np.asarray([batch_size], dtype=np.float64)
        cold = float(self.cold_array(b, np.asarray([1.0 - tail_hit_rate]))[0])
        return self.cq_seconds(batch_size) + cold

    def required_hit_rate(self, batch_size: float, seconds: float) -> float | None:
        """The smallest tail hit rate keeping the batch within ``seconds``; ``None`` when even
        an all-GPU scan is too slow."""
        eta = float(self.required_hit_rates(np.asarray([batch_size]), np.asarray([seconds]))[0])
        return None if math.isinf(eta) else eta


@dataclass(frozen=True)
class SearchLatencyModel(JsonFile, LatencyModel):
    """CPU search at one ``nprobe``: ``T_CQ(b)``, ``T_LUT(b)`` (seconds). NOTE: predictions are
    the non-decreasing envelope over batch sizes ``1..b``, clamped at 0, which makes Algorithm
    1's feasibility monotone in coverage and its bisection exact."""

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
        """Both stages from measurements (one entry per measured batch, repeats allowed)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        if b.size and b.min() < 1:
            raise ValueError(f"batch_sizes must be >= 1, got min {b.min()}")
        for name, s in (("cq_seconds", cq_seconds), ("lut_seconds", lut_seconds)):
            if np.any(np.asarray(s, dtype=np.float64) < 0):
                raise ValueError(f"{name} must be >= 0")
        cq = fit_piecewise_linear(b, cq_seconds, max_segments=max_segments)
        lut = fit_piecewise_linear(b, lut_seconds, max_segments=max_segments)
        return cls(nprobe, cq, lut)

    def cold_array(self, batch_sizes: np.ndarray, cold: np.ndarray) -> np.ndarray:
        return self.lut_array(batch_sizes) * cold

    def required_hit_rates(self, batch_sizes: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Vectorised ``required_hit_rate``; ``inf`` marks the infeasible entries."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        cq, lut = self.cq_array(b), self.lut_array(b)
        budget = np.asarray(seconds, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            eta = np.clip(np.where(lut > 0, (cq + lut - budget) / lut, 0.0), 0.0, None)
        return np.where((cq > budget) | (eta > 1.0), np.inf, eta)

    def cq_array(self, batch_sizes: np.ndarray) -> np.ndarray:
        return _envelope(self.cq, batch_sizes)

    def lut_array(self, batch_sizes: np.ndarray) -> np.ndarray:
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


def _envelope(f: PiecewiseLinear, batch_sizes: np.ndarray) -> np.ndarray:
    """``max(0, max over x in [1, b] of f(x))`` for every ``b`` (batch sizes ``>= 1``)."""
    b = np.maximum(np.asarray(batch_sizes, dtype=np.float64), 1.0)
    knots = np.asarray(f.knots)
    points = np.concatenate([[1.0], knots[knots > 1.0]])
    at_points = np.maximum.accumulate(f.evaluate(points))
    idx = np.searchsorted(points, b, side="right") - 1
    return np.maximum(0.0, np.maximum(at_points[idx], f.evaluate(b)))
