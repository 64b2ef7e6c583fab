"""The retrieval side of co-scheduling: staged retrievals advanced one sub-stage per ``step``.

``StagedRetrievalRunner`` is a ``RetrievalRunner`` (plain tasks are still searched in one shot)
that also keeps ``StagedRetrievalTask``s active across calls::

    run(tasks):  plain tasks -> one-shot search (as before)
                 staged tasks -> embed (one batch), assign, order clusters  -> active
                 one sub-stage: per active retrieval, the next clusters under the budget mb;
                 all of them scanned as one batch; partial top-k merged; finished -> result

The worker loop keeps calling ``run([])`` while ``has_pending()``, draining its inbox between
sub-stages. Every cluster of each probe list is scanned exactly once, so the final top-k is
the one-shot result whatever the cut and order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragserve.graph import Passage
from ragserve.runtime.runners import RetrievalRunner
from ragserve.scheduler import RetrievalResult, RetrievalTask
from ragserve.scheduler.cost_model import ScanCostModel, pack_clusters
from ragserve.scheduler.similarity import reorder_probes
from ragserve.scheduler.staged_messages import (
    RetrievalPartial,
    StagedRetrievalResult,
    StagedRetrievalTask,
)

logger = logging.getLogger(__name__)


@dataclass
class _Stage:
    """One active staged retrieval (mutated by ``step``)."""

    task: StagedRetrievalTask
    query: np.ndarray  # [dim]
    cluster_ids: np.ndarray  # scan order, no pads
    coarse_dists: np.ndarray
    probed: tuple[int, ...]  # coarse order
    k: int
    pos: int = 0
    state: Any = None  # TopK [1, k]
    num_substages: int = 0
    scan_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.cluster_ids)


class StagedRetrievalRunner(RetrievalRunner):
    """``RetrievalRunner`` plus step-wise execution of staged retrievals (see module doc)."""

    def __init__(
        self,
        index: Any,
        embedder: Any,
        default_nprobe: int | None = None,
        cost: ScanCostModel | None = None,
    ) -> None:
        super().__init__(index, embedder, default_nprobe)
        self.cost = cost or ScanCostModel()
        self._active: dict[str, _Stage] = {}
        self._sizes: np.ndarray | None = None
        self._cluster_of: np.ndarray | None = None
        self._num_docs: int | None = None
        self._last_scan_end: float | None = None
        self.num_steps = 0

    def has_pending(self) -> bool:
        return bool(self._active)

    def run(self, tasks: list[RetrievalTask]) -> tuple[list, np.ndarray, np.ndarray]:
        default_mode = getattr(self.index, "default_mode", "dense")
        by_text = [t for t in tasks if (t.mode or default_mode) != "dense" or t.filter]
        plain = [t for t in tasks if not isinstance(t, StagedRetrievalTask) or t in by_text]
        staged = [t for t in tasks if t not in plain]
        updates: list = []
        ids = np.full((0, 1), -1, np.int64)
        scores = np.zeros((0, 1), np.float32)
        if plain:
            results, ids, scores = super().run(plain)
            updates.extend(results)
        if staged:
            updates.extend(self._add(staged))
        if self._active:
            updates.extend(self._step())
        return updates, ids, scores

    # -- admission --------------------------------------------------------------------------
    def _add(self, tasks: list[StagedRetrievalTask]) -> list[RetrievalResult]:
        try:
            self._refresh_sizes()
            vectors = self.embedder.encode([t.query for t in tasks], is_query=True)
            for i, t in enumerate(tasks):
                plan = self.index.assign(vectors[i : i + 1], t.nprobe or self.default_nprobe)
                row, dists = plan.cluster_ids[0], plan.coarse_dists[0]
                order = reorder_probes(row, t.hit_clusters, t.previous_clusters)
                stage = _Stage(
                    task=t,
                    query=vectors[i],
                    cluster_ids=row[order],
                    coarse_dists=dists[order],
                    probed=tuple(int(c) for c in row if c >= 0),
                    k=max(t.topk, t.cache_topk),
                )
                self.cost.observe_stage(int(self._sizes[stage.cluster_ids].sum()))
                self._active[t.task_id] = stage
        except Exception as exc:
            logger.exception("staged retrieval admission failed")
            err = f"{type(exc).__name__}: {exc}"
            for t in tasks:
                self._active.pop(t.task_id, None)
            return [RetrievalResult(t.task_id, (), err) for t in tasks]
        return []

    # -- one sub-stage ----------------------------------------------------------------------
    def _step(self) -> list:
        stages = list(self._active.values())
        try:
            return self._scan_substage(stages)
        except Exception as exc:
            logger.exception("staged retrieval sub-stage failed")
            err = f"{type(exc).__name__}: {exc}"
            self._active.clear()
            return [RetrievalResult(s.task.task_id, (), err) for s in stages]

    def _scan_substage(self, stages: list[_Stage]) -> list:
        from ragserve.retrieval import ProbePlan, TopK
        from ragserve.retrieval.stepwise import merge

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
        kmax = max(s.k for s in stages)
        t0 = time.perf_counter()
        part = self.index.scan(queries, ProbePlan(cids, dists), kmax)
        t1 = time.perf_counter()
        pairs = int(self._sizes[np.where(cids < 0, 0, cids)][cids >= 0].sum())
        self.cost.observe_scan(pairs, t1 - t0)
        is_l2 = self.index.spec.is_l2
        updates: list = []
        for i, (s, n) in enumerate(zip(stages, takes, strict=True)):
            row = TopK(part.ids[i : i + 1, : s.k], part.scores[i : i + 1, : s.k])
            s.state = merge(s.state, row, is_l2)
            s.pos += n
            s.num_substages += 1
            share = self._sizes[cids[i, :n]].sum() / max(pairs, 1)
            s.scan_seconds += (t1 - t0) * float(share)
            if s.done:
                del self._active[s.task.task_id]
                updates.append(self._final(s))
            elif s.task.emit_partials:
                passages = self._passages(s.state.ids[0, : s.task.topk], s.state.scores[0])
                updates.append(RetrievalPartial(s.task.task_id, passages, s.num_substages))
        self.num_steps += 1
        end = time.perf_counter()
        self.cost.observe_overhead(gap + (end - start) - (t1 - t0))
        self._last_scan_end = end if self._active else None
        return updates

    def _num_next(self, s: _Stage) -> int:
        remaining = len(s.cluster_ids) - s.pos
        t = s.task
        if s.num_substages == 0 and t.first_clusters > 0:
            return min(t.first_clusters, remaining)
        budget = self.cost.budget(t.budget_s) if t.split else None
        if budget is None:
            return remaining
        costs = self.cost.cluster_seconds(self._sizes[s.cluster_ids[s.pos :]])
        return pack_clusters(costs, budget)

    def _final(self, s: _Stage) -> StagedRetrievalResult:
        ids, scores = s.state.ids[0], s.state.scores[0]
        hit: tuple[int, ...] = ()
        if s.task.cache_topk > 0:
            best = ids[: s.task.cache_topk]
            hit = tuple(dict.fromkeys(int(c) for c in self._clusters_of(best[best >= 0])))
        return StagedRetrievalResult(
            s.task.task_id,
            self._passages(ids[: s.task.topk], scores),
            hit_clusters=hit,
            probed_clusters=s.probed,
            num_substages=s.num_substages,
            scan_seconds=s.scan_seconds,
        )

    def _passages(self, ids: np.ndarray, scores: np.ndarray) -> tuple[Passage, ...]:
        row = [int(x) for x in ids if x >= 0]
        docs = self.index.get_documents(row) if row else []
        return tuple(
            Passage(d.id, d.text, d.title, float(scores[j]))
            for j, d in enumerate(docs)
            if d is not None
        )

    # -- index metadata ---------------------------------------------------------------------
    def _refresh_sizes(self) -> None:
        n = self.index.num_documents
        if self._sizes is None or n != self._num_docs:
            self._sizes = self.index.cluster_sizes()
            self._num_docs = n
            self._cluster_of = None

    def _clusters_of(self, ids: np.ndarray) -> np.ndarray:
        """The inverted list holding each Faiss row id (a map rebuilt when ids are unknown)."""
        if self._cluster_of is None or (ids.size and ids.max() >= len(self._cluster_of)):
            self._cluster_of = _cluster_map(self.index)
        ids = ids[ids < len(self._cluster_of)]
        return self._cluster_of[ids]


def _cluster_map(index: Any) -> np.ndarray:
    """int64 ``[max_id + 1]``: the list of every row id (``-1`` where none) from invlists."""
    import faiss

    ivf = index.faiss_index
    invlists = ivf.invlists
    parts: list[tuple[int, np.ndarray]] = []
    # NOTE: read under the index's shared lock, as its own scans are (upserts take it
    # exclusively); the map is only an ordering hint, never part of a result.
    with index._rw.read():
        for c in range(ivf.nlist):
            n = invlists.list_size(c)
            if n:
                ptr = invlists.get_ids(c)
                parts.append((c, faiss.rev_swig_ptr(ptr, n).copy()))
                invlists.release_ids(c, ptr)
    top = max((int(ids.max()) for _, ids in parts), default=-1)
    out = np.full(top + 1, -1, np.int64)
    for c, ids in parts:
        out[ids] = c
    return out
