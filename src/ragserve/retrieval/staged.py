"""Staged search (HedraRAG §4.2): many queries' IVF searches advanced one sub-stage at a time,
each sub-stage's clusters packed under Eq. 1's budget ``mb`` (``StageCostModel``).

```
add(key, query, ...):  assign (nprobe), order the probe list (reorder_probes)  -> active
step():                per active search, the next clusters under the budget mb; all of them
                       scanned as ONE batch through `VectorIndex.scan` (GPU tier + CPU);
                       partial top-k merged per search -> one `StageProgress` per search
```

Eq. 1: a stage of mean duration ``t_R`` cut into sub-stages of budget ``mb`` gains
``(t_R - mb) / 2 - (t_R / mb) * beta`` (``beta``: a sub-stage boundary's overhead; the paper
prints ``+``, with which the argmax is ``mb -> 0``), maximal at ``mb* = sqrt(2 t_R beta)``.
Every cluster is scanned exactly once, so a finished search's top-k is the one-shot result.
Clusters resident in the GPU tier cost no CPU time in the packing (VectorLiteRAG's early
completion). Mutated only by its owner's thread; the index it searches may be shared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.index import VectorIndex
from ragserve.retrieval.stepwise import merge
from ragserve.retrieval.types import ProbePlan, TopK


def expected_gain(mb: float, t_retrieval: float, beta: float) -> float:
    """Eq. 1: expected latency gain (s) of sub-stages of budget ``mb`` (s)."""
    if mb <= 0:
        raise ValueError(f"mb must be > 0, got {mb}")
    return (t_retrieval - mb) / 2 - (t_retrieval / mb) * beta


def optimal_budget(t_retrieval: float, beta: float) -> float | None:
    """argmax of Eq. 1 over ``0 < mb <= t_retrieval``; ``None`` when splitting does not pay."""
    if t_retrieval <= 0 or beta <= 0:  # NOTE: no measured overhead: never infinitely many pieces
        return None
    mb = math.sqrt(2.0 * t_retrieval * beta)
    # NOTE: a stage mean decayed towards zero (every probed list on the GPU tier) underflows
    # 2 t_R beta to 0.0: no budget then, not a ValueError per step
    if not mb > 0 or mb >= t_retrieval or expected_gain(mb, t_retrieval, beta) <= 0:
        return None
    return mb


def pack_clusters(costs: Sequence[float] | np.ndarray, budget: float) -> int:
    """How many of the next clusters (seconds, in scan order) fit in ``budget``: added until
    the budget is reached, at least one (the smallest schedulable unit)."""
    c = np.asarray(costs, dtype=np.float64)
    if c.size == 0:
        return 0
    reached = np.flatnonzero(np.cumsum(c) >= budget)
    return int(reached[0]) + 1 if reached.size else int(c.size)


class StageCostModel:
    """Moving averages the staged search feeds: ``seconds_per_vector`` (scan time per
    (query, vector) pair), ``beta`` (a sub-stage's time outside the scan) and
    ``mean_stage_seconds`` (``t_R``). Mutated only by its owner's thread."""

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
        if num_vector_pairs <= 0 or seconds <= 0:
            return
        old = self.seconds_per_vector if self.num_scans else None  # the prior: replaced
        self.seconds_per_vector = self._ema(old, seconds / num_vector_pairs)
        self.num_scans += 1

    def observe_overhead(self, seconds: float) -> None:
        self.beta = self._ema(self.beta, max(seconds, 0.0))

    def observe_stage(self, num_vectors: int) -> None:
        """A new stage that will scan ``num_vectors`` vectors in all."""
        self.mean_stage_seconds = self._ema(
            self.mean_stage_seconds, num_vectors * self.seconds_per_vector
        )

    def cluster_seconds(self, sizes: np.ndarray, on_gpu: np.ndarray | None = None) -> np.ndarray:
        """CPU seconds of each cluster for one query; those ``on_gpu`` cost none."""
        costs = np.asarray(sizes, dtype=np.float64) * self.seconds_per_vector
        return costs if on_gpu is None else np.where(on_gpu, 0.0, costs)

    def budget(self, override: float | None = None) -> float | None:
        """``mb`` for the next sub-stage: ``override``, else Eq. 1's optimum."""
        if override is not None:
            return override
        if self.mean_stage_seconds is None or self.beta is None:
            return None
        return optimal_budget(self.mean_stage_seconds, self.beta)


def reorder_probes(
    probe_row: np.ndarray, hit_clusters: Iterable[int], previous_clusters: Iterable[int]
) -> np.ndarray:
    """Positions (probe ranks) of ``probe_row`` in local-cache order; ``-1`` pads are dropped.

    ```
    probe_row  = [7, 3, 9, 1, 4]      hit = {9}     previous = {3, 9, 4}
    groups     =  2  1  0  2  1   ->  ranks [2, 1, 4, 0, 3]  (clusters 9 | 3 4 | 7 1)
    ```
    """
    row = np.asarray(probe_row, dtype=np.int64)
    hit = np.fromiter(hit_clusters, dtype=np.int64)
    prev = np.fromiter(previous_clusters, dtype=np.int64)
    group = np.where(np.isin(row, hit), 0, np.where(np.isin(row, prev), 1, 2))
    ranks = np.flatnonzero(row >= 0)
    return ranks[np.argsort(group[ranks], kind="stable")]


@dataclass(frozen=True)
class StageParams:
    """How one search is staged: ``split`` cuts it under the budget (``budget_s`` or Eq. 1's
    learned ``mb``); ``first_clusters`` > 0 makes the first sub-stage exactly that many."""

    k: int
    nprobe: int | None = None
    split: bool = True
    budget_s: float | None = None
    first_clusters: int = 0
    hit_clusters: tuple[int, ...] = ()
    previous_clusters: tuple[int, ...] = ()


@dataclass(frozen=True)
class StageProgress:
    """One search after a sub-stage: its merged top-k so far (``[1, k]``), and whether done."""

    key: str
    state: TopK
    done: bool
    num_substages: int
    scan_seconds: float
    probed_clusters: tuple[int, ...]


@dataclass
class _Stage:
    """One active staged search (mutated by ``StagedSearch.step``)."""

    key: str
    params: StageParams
    query: np.ndarray  # [dim]
    cluster_ids: np.ndarray  # scan order, no pads
    coarse_dists: np.ndarray
    probed: tuple[int, ...]  # coarse order
    pos: int = 0
    state: TopK | None = None  # [1, k]
    num_substages: int = 0
    scan_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.cluster_ids)


class StagedSearch:
    """Active staged searches over one `VectorIndex` (see module doc)."""

    def __init__(self, index: VectorIndex, cost: StageCostModel | None = None) -> None:
        self.index = index
        self.cost = cost or StageCostModel()
        self._active: dict[str, _Stage] = {}
        self._sizes: np.ndarray | None = None
        self._num_docs: int | None = None
        self._last_scan_end: float | None = None
        self.num_steps = 0

    def has_pending(self) -> bool:
        return bool(self._active)

    def add(self, key: str, query: np.ndarray, params: StageParams) -> None:
        """Start a search (``query``: ``[dim]``); ``key`` must not be active."""
        if key in self._active:
            raise ValueError(f"staged search {key!r} is already active")
        if params.k < 1:
            raise ValueError(f"k must be >= 1, got {params.k}")
        self._refresh_sizes()
        plan = self.index.assign(query[None, :], params.nprobe)
        row, dists = plan.cluster_ids[0], plan.coarse_dists[0]
        order = reorder_probes(row, params.hit_clusters, params.previous_clusters)
        stage = _Stage(
            key=key,
            params=params,
            query=np.asarray(query, dtype=np.float32),
            cluster_ids=row[order],
            coarse_dists=dists[order],
            probed=tuple(int(c) for c in row if c >= 0),
        )
        on_gpu = self.index.resident_mask(stage.cluster_ids)
        self.cost.observe_stage(int(self._sizes[stage.cluster_ids][~on_gpu].sum()))
        self._active[key] = stage

    def discard(self, keys: Iterable[str]) -> None:
        """Forget active searches (failed admission, aborted)."""
        for key in keys:
            self._active.pop(key, None)

    def clear(self) -> list[str]:
        """Forget every active search; returns their keys."""
        keys = list(self._active)
        self._active.clear()
        return keys

    def step(self) -> list[StageProgress]:
        """Scan one sub-stage of every active search as one batch (see module doc)."""
        stages = list(self._active.values())
        if not stages:
            return []
        start = time.perf_counter()
        # NOTE: beta = a sub-stage's time outside the scan: this step's bookkeeping plus, for
        # back-to-back sub-stages, the worker loop's gap (messages, inbox) since the last one.
        gap = 0.0 if self._last_scan_end is None else start - self._last_scan_end
        takes = [self._num_next(s) for s in stages]
        width = max(takes)
        cids = np.full((len(stages), width), -1, np.int64)
        dists = np.zeros((len(stages), width), np.float32)
        for i, (s, n) in enumerate(zip(stages, takes, strict=True)):
            cids[i, :n] = s.cluster_ids[s.pos : s.pos + n]
            dists[i, :n] = s.coarse_dists[s.pos : s.pos + n]
        queries = np.stack([s.query for s in stages])
        kmax = max(s.params.k for s in stages)
        cpu_cids = np.where(self.index.resident_mask(cids), -1, cids)
        t0 = time.perf_counter()
        part = self.index.scan(queries, ProbePlan(cids, dists), kmax)
        t1 = time.perf_counter()
        pairs = int(self._sizes[cpu_cids[cpu_cids >= 0]].sum())
        self.cost.observe_scan(pairs, t1 - t0)
        is_l2 = self.index.spec.is_l2
        out = []
        for i, (s, n) in enumerate(zip(stages, takes, strict=True)):
            k = s.params.k
            row = TopK(part.ids[i : i + 1, :k], part.scores[i : i + 1, :k])
            s.state = merge(s.state, row, is_l2)
            s.pos += n
            s.num_substages += 1
            mine = cpu_cids[i, :n]
            share = self._sizes[mine[mine >= 0]].sum() / max(pairs, 1)
            s.scan_seconds += (t1 - t0) * float(share)
            if s.done:
                del self._active[s.key]
            out.append(
                StageProgress(s.key, s.state, s.done, s.num_substages, s.scan_seconds, s.probed)
            )
        self.num_steps += 1
        end = time.perf_counter()
        self.cost.observe_overhead(gap + (end - start) - (t1 - t0))
        self._last_scan_end = end if self._active else None
        return out

    def _num_next(self, s: _Stage) -> int:
        remaining = len(s.cluster_ids) - s.pos
        p = s.params
        if s.num_substages == 0 and p.first_clusters > 0:
            return min(p.first_clusters, remaining)
        budget = self.cost.budget(p.budget_s) if p.split else None
        if budget is None:
            return remaining
        rest = s.cluster_ids[s.pos :]
        costs = self.cost.cluster_seconds(self._sizes[rest], self.index.resident_mask(rest))
        return pack_clusters(costs, budget)

    def _refresh_sizes(self) -> None:
        n = self.index.num_documents
        if self._sizes is None or n != self._num_docs:
            self._sizes = self.index.cluster_sizes()
            self._num_docs = n
