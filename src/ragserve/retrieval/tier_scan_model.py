"""The cost model that picks the GPU tier's scan strategy per batch (``scan="auto"``).

Each strategy's seconds are linear in what it reads and scores, with coefficients measured on
the tier itself (``GpuTier.calibrate``: timed scans of random resident probes at a few batch
sizes and probe widths), fitted by non-negative least squares on relative error::

    dense   = d0 + d1 * span_rows + d2 * queries * span_rows
    grouped = g0 + g1 * gathered_rows + g2 * scored_rows
    fused   = f0 + f1 * gathered_rows + f2 * scored_rows      (read in place, no copy)

``span_rows``: rows of the pool the dense scan reads (every resident chunk, probed or not);
``gathered_rows``: rows of the distinct probed chunks the grouped scan copies;
``scored_rows``: (padded query, row) scores of its ``bmm`` groups. The fused scan (a Triton
kernel, CUDA only) has the grouped scan's terms with its own coefficients; a model fitted
without fused timings (``fused`` None) chooses between the other two.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

STRATEGIES = ("grouped", "dense", "fused")
REQUIRED = ("grouped", "dense")  # every fitted model has these; fused where it was timed


class ScanFeatures(NamedTuple):
    """What one batch's scan would read, per strategy (module doc)."""

    num_queries: int
    span_rows: int
    gathered_rows: int
    scored_rows: int

    def terms(self, strategy: str) -> np.ndarray:
        if strategy == "dense":
            return np.array([1.0, self.span_rows, self.num_queries * self.span_rows])
        if strategy in ("grouped", "fused"):
            return np.array([1.0, self.gathered_rows, self.scored_rows])
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


class ScanSample(NamedTuple):
    """One calibration measurement: a batch's features and the seconds of the strategies
    timed on it (some or all)."""

    features: ScanFeatures
    seconds: dict[str, float]


@dataclass(frozen=True)
class ScanCostModel:
    """Fitted coefficients (seconds per term of ``ScanFeatures.terms``) of each strategy."""

    dense: tuple[float, float, float]
    grouped: tuple[float, float, float]
    setting: tuple = ()  # what it was measured on (``GpuTier.model_setting``)
    span_rows: int = 0  # the calibrated tier's span
    fused: tuple[float, float, float] | None = None  # None: not timed (no Triton or no CUDA)

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategies this model predicts (``choose`` picks among them)."""
        return tuple(s for s in STRATEGIES if getattr(self, s) is not None)

    def fits(self, setting: tuple, span_rows: int) -> bool:
        """Whether this model may serve a tier of ``setting`` and ``span_rows``: the same
        device, dtype and shapes, and a span within a factor of 2 of the calibrated one."""
        return setting == self.setting and self.span_rows <= 2 * span_rows <= 4 * self.span_rows

    def predict(self, strategy: str, features: ScanFeatures) -> float:
        if strategy not in self.strategies:
            raise ValueError(f"strategy must be one of {self.strategies}, got {strategy!r}")
        return float(np.dot(getattr(self, strategy), features.terms(strategy)))

    def choose(self, features: ScanFeatures) -> str:
        """The strategy predicted fastest (on a tie the first of grouped, dense, fused)."""
        seconds = [self.predict(s, features) for s in self.strategies]
        return self.strategies[int(np.argmin(seconds))]

    @classmethod
    def fit(
        cls, samples: Sequence[ScanSample], setting: tuple = (), span_rows: int = 0
    ) -> ScanCostModel:
        """Non-negative least squares on relative error over ``samples`` (at least 3 timing
        grouped and dense each; fused fitted when 3 time it)."""
        coef = {}
        for strategy in STRATEGIES:
            timed = [s for s in samples if strategy in s.seconds]
            if strategy not in REQUIRED and len(timed) < 3:
                continue
            if len(timed) < 3:
                raise ValueError(f"samples: 3 of {strategy} are needed to fit, got {len(timed)}")
            a = np.stack([s.features.terms(strategy) for s in timed])
            t = np.array([s.seconds[strategy] for s in timed], dtype=np.float64)
            if not np.all(np.isfinite(t)) or np.any(t <= 0):
                raise ValueError(f"samples: {strategy} seconds must be positive, got {t}")
            coef[strategy] = tuple(float(c) for c in nnls_relative(a, t))
        return cls(coef["dense"], coef["grouped"], setting, span_rows, coef.get("fused"))


def nnls_relative(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``sum(((a @ x) - t) / t) ** 2``: the best unconstrained fit over
    every subset of the columns whose solution is non-negative (three columns: eight fits)."""
    w = a / t[:, None]
    scale = np.maximum(np.abs(w).max(0), 1e-300)  # columns differ by orders of magnitude
    w = w / scale
    ones = np.ones(len(t))
    best, best_err = np.zeros(a.shape[1]), float(len(t))  # x = 0: every relative error is 1
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(w[:, cols], ones, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((w[:, cols] @ x - ones) ** 2))
            if err < best_err:
                best = np.zeros(a.shape[1])
                best[list(cols)] = x
                best_err = err
    return best / scale
