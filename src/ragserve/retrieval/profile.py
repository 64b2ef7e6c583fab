"""The measured search profile: CPU (or tier) scan seconds on a grid of batch sizes x clusters
scanned per query (`measure_profile`, `measure_scan_grid`), and `SearchProfile.predict(b, c)`,
its bilinear interpolation, extended past the grid with the end segments' slopes
(`PiecewiseLinear`, which `latency_model` fits).

```
seconds[i][j] = median time of scan(queries[:batch_sizes[i]], plan.columns(0, clusters[j]))
```
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.storage import JsonFile
from ragserve.retrieval.types import ScanIndex


@dataclass(frozen=True)
class PiecewiseLinear:
    """A continuous piecewise-linear function through ``(knots[i], values[i])``.

    ``knots`` strictly ascending; outside ``[knots[0], knots[-1]]`` the end segments extend
    linearly (a single knot is a constant).
    """

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
        """Slope of each of the ``len(knots) - 1`` segments."""
        k, v = np.asarray(self.knots), np.asarray(self.values)
        return tuple(float(s) for s in np.diff(v) / np.diff(k))

    def __call__(self, x: float) -> float:
        return float(self.evaluate(np.asarray([x], dtype=np.float64))[0])

    def evaluate(self, x: np.ndarray) -> np.ndarray:
        """Values at every element of ``x`` (float64, same shape)."""
        xs = np.asarray(x, dtype=np.float64)
        k, v = np.asarray(self.knots), np.asarray(self.values)
        if len(k) == 1:
            return np.full(xs.shape, v[0])
        out = np.interp(xs, k, v)
        lo_slope = (v[1] - v[0]) / (k[1] - k[0])
        hi_slope = (v[-1] - v[-2]) / (k[-1] - k[-2])
        out = np.where(xs < k[0], v[0] + lo_slope * (xs - k[0]), out)
        return np.where(xs > k[-1], v[-1] + hi_slope * (xs - k[-1]), out)


@dataclass(frozen=True)
class SearchProfile(JsonFile):
    """Measured CPU search time (seconds) of one scan step, by batch size and clusters/query."""

    batch_sizes: tuple[int, ...]
    cluster_counts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][len(cluster_counts)]
    topk: int = 10

    def predict(self, batch_size: float, clusters_per_query: float) -> float:
        """Estimated seconds for one scan of `batch_size` queries × `clusters_per_query`."""
        per_batch = [PiecewiseLinear(self.cluster_counts, row) for row in self.seconds]
        at = tuple(f(clusters_per_query) for f in per_batch)
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


def measure_profile(
    index: ScanIndex,
    queries: np.ndarray,
    *,
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64),
    cluster_counts: tuple[int, ...] | None = None,
    topk: int = 10,
    repeats: int = 3,
) -> SearchProfile:
    """Time `index.scan` over the grid; `queries` needs at least `max(batch_sizes)` rows."""
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
    """Time ``run(batch_size, clusters_per_query)`` over the grid into a ``SearchProfile``.

    For a GPU (or CPU-tensor) tier pass a closure that scans ``batch_size`` queries over
    ``clusters_per_query`` resident lists each, and ``synchronize`` (e.g.
    ``torch.cuda.synchronize``) so that each timing covers the device work. Each point is the
    median of ``repeats`` after ``warmup`` untimed calls.
    """
    if not batch_sizes or not cluster_counts:
        raise ValueError("batch_sizes and cluster_counts must be non-empty")
    if min(batch_sizes) < 1 or min(cluster_counts) < 1:
        raise ValueError("batch_sizes and cluster_counts must be >= 1")
    if list(batch_sizes) != sorted(set(batch_sizes)) or list(cluster_counts) != sorted(
        set(cluster_counts)
    ):
        raise ValueError("batch_sizes and cluster_counts must be strictly ascending")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    sync = synchronize or (lambda: None)
    seconds = []
    for b in batch_sizes:
        row = []
        for c in cluster_counts:
            for _ in range(warmup):
                run(b, c)
            sync()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run(b, c)
                sync()
                times.append(time.perf_counter() - t0)
            row.append(float(np.median(times)))
        seconds.append(tuple(row))
    return SearchProfile(tuple(batch_sizes), tuple(cluster_counts), tuple(seconds), topk)
