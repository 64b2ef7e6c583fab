"""Retrieval cost model: HedraRAG's sub-stage time budget ``mb`` (Eq. 1) and cluster packing.

Eq. 1 models the latency gain of cutting a retrieval stage of mean duration ``t_R`` into
sub-stages of budget ``mb``: a newly arriving retrieval waits ``mb / 2`` instead of ``t_R / 2``
for the running search, but every sub-stage boundary costs the scheduling overhead ``beta``::

    gain(mb) = (t_R - mb) / 2  -  (t_R / mb) * beta        (the paper prints "+ ... beta"; with
    d gain / d mb = -1/2 + t_R * beta / mb**2 = 0           a plus sign the argmax is mb -> 0,
    mb* = sqrt(2 * t_R * beta)                              so the overhead term must subtract)

All times are seconds. Nothing here imports faiss or torch: the staged search
(``retrieval/staged.py``) feeds the measurements in (``ScanCostModel.observe_*``) and asks for a
budget and a packing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def expected_gain(mb: float, t_retrieval: float, beta: float) -> float:
    """Eq. 1: expected latency gain (s) of sub-stages of budget ``mb`` (s)."""
    if mb <= 0:
        raise ValueError(f"mb must be > 0, got {mb}")
    return (t_retrieval - mb) / 2 - (t_retrieval / mb) * beta


def optimal_budget(t_retrieval: float, beta: float) -> float | None:
    """argmax of Eq. 1 over ``0 < mb <= t_retrieval``; ``None`` when splitting does not pay.

    Splitting pays only if the best gain is positive, i.e. ``t_R > 2 * beta`` (then
    ``mb* = sqrt(2 t_R beta) < t_R``).
    """
    if t_retrieval <= 0:
        return None
    if beta <= 0:
        return None  # NOTE: no measured overhead yet: refuse to split into infinitely many pieces
    mb = math.sqrt(2.0 * t_retrieval * beta)
    # NOTE: a stage mean decayed towards zero (every probed list resident on the GPU tier costs
    # the CPU nothing) underflows 2 t_R beta to 0.0: no budget then, not a ValueError per step
    if not mb > 0 or mb >= t_retrieval or expected_gain(mb, t_retrieval, beta) <= 0:
        return None
    return mb


def pack_clusters(costs: Sequence[float] | np.ndarray, budget: float) -> int:
    """How many of the next clusters (costs in seconds, in scan order) fit in ``budget``.

    Clusters are added one by one until the budget is reached; at least one is always taken
    (a single cluster over budget is still the smallest schedulable unit).

    ```
    costs:  [0.4, 0.3, 0.5, 0.2]   budget 1.0 -> 0.4+0.3 = 0.7; +0.5 = 1.2 >= 1.0 -> 3 clusters
    ```
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.size == 0:
        return 0
    reached = np.flatnonzero(np.cumsum(c) >= budget)
    return int(reached[0]) + 1 if reached.size else int(c.size)


class ScanCostModel:
    """Online estimates (exponential moving averages) fed by the retrieval worker.

    - ``seconds_per_vector``: scan time per (query, vector) pair scanned,
    - ``beta``: per-sub-stage overhead (step time not explained by vectors scanned),
    - ``mean_stage_seconds``: ``t_R``, the estimated unsplit scan time of one retrieval stage.

    Mutated only by its owner's thread.
    """

    def __init__(
        self, seconds_per_vector: float = 2e-8, beta: float | None = None, alpha: float = 0.2
    ) -> None:
        self.seconds_per_vector = seconds_per_vector
        self.beta = beta
        self.mean_stage_seconds: float | None = None
        self.alpha = alpha
        self.num_scans = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_scan(self, num_vector_pairs: int, seconds: float) -> None:
        """One batched scan over ``num_vector_pairs`` (query, vector) pairs took ``seconds``."""
        if num_vector_pairs <= 0 or seconds <= 0:
            return
        rate = seconds / num_vector_pairs
        self.seconds_per_vector = (
            rate if self.num_scans == 0 else self._ema(self.seconds_per_vector, rate)
        )
        self.num_scans += 1

    def observe_overhead(self, seconds: float) -> None:
        """Time one sub-stage spent outside the scan itself (bookkeeping, messages, merge)."""
        self.beta = self._ema(self.beta, max(seconds, 0.0))

    def observe_stage(self, num_vectors: int) -> None:
        """A new retrieval stage that will scan ``num_vectors`` vectors in all."""
        self.mean_stage_seconds = self._ema(
            self.mean_stage_seconds, num_vectors * self.seconds_per_vector
        )

    def cluster_seconds(self, sizes: np.ndarray, on_gpu: np.ndarray | None = None) -> np.ndarray:
        """Estimated CPU scan time of each cluster (``sizes``: vectors per cluster) for one
        query; clusters flagged in ``on_gpu`` (resident in the GPU tier) cost none."""
        costs = np.asarray(sizes, dtype=np.float64) * self.seconds_per_vector
        return costs if on_gpu is None else np.where(on_gpu, 0.0, costs)

    def budget(self, override: float | None = None) -> float | None:
        """``mb`` for the next sub-stage: ``override`` if given, else Eq. 1's optimum."""
        if override is not None:
            return override
        if self.mean_stage_seconds is None or self.beta is None:
            return None
        return optimal_budget(self.mean_stage_seconds, self.beta)
