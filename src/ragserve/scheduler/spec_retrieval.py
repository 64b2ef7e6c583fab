"""Speculative retrieval (HedraRAG §4.3): while a generation whose output feeds the next
retrieval is still running, search with its partial text and warm the request's local cache.

```
generation G (hypo):  [t t t t t t t t t t t t]        retrieval R(query = hypo)
                            └─ at `fraction` of max_tokens: search(partial hypo) ─┐
                                                          local cache (H_v, C_v) ◀┘
R then scans the clusters of the partial's results first (similarity.py's reordering).
```

Exact by construction: the speculative search only changes the order R scans its own
clusters in. Its result never reaches the scheduler. Needs the ``SimilarityTransform`` whose
cache it warms.
"""

from __future__ import annotations

import itertools

from ragserve.graph import GenerationNode, RetrievalNode
from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import (
    GenerationUpdate,
    StagedRetrievalResult,
    StagedRetrievalTask,
    Wavefront,
)
from ragserve.scheduler.similarity import CacheEntry, SimilarityTransform
from ragserve.scheduler.transforms import BaseTransform, SchedulerView

PREFIX = "specret/"


class SpeculativeRetrievalTransform(BaseTransform):
    """Issue one speculative retrieval per generation run once ``fraction`` of its
    ``max_tokens`` exist, if the node after it is a retrieval reading its output."""

    needs_partial_updates = True  # it fires on a partial text

    def __init__(self, similarity: SimilarityTransform, fraction: float = 0.5) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.similarity = similarity
        self.fraction = fraction
        self.num_issued = 0
        self.num_warmed = 0
        self._view: SchedulerView | None = None
        self._done: set[str] = set()  # generation task ids already handled
        self._pending: dict[str, str] = {}  # speculative task id -> request id
        self._seq = itertools.count()

    def bind(self, view: SchedulerView) -> None:
        self._view = view

    def apply(self, wavefront: Wavefront) -> Wavefront:
        return wavefront

    def on_updates(self, updates: list[Update]) -> list[Update]:
        out: list[Update] = []
        issue: list[StagedRetrievalTask] = []
        for u in updates:
            if u.task_id in self._pending:
                rid = self._pending.pop(u.task_id)
                if isinstance(u, StagedRetrievalResult) and u.error is None:
                    self.similarity.warm(rid, CacheEntry(u.hit_clusters, u.probed_clusters))
                    self.num_warmed += 1
                continue
            out.append(u)
            if isinstance(u, GenerationUpdate) and not u.finished:
                task = self._maybe_issue(u)
                if task is not None:
                    issue.append(task)
            elif isinstance(u, GenerationUpdate):
                self._done.discard(u.task_id)
        if issue:
            self._view.submit_retrieval(issue)  # dispatched with the next wavefront
        return out

    def _maybe_issue(self, update: GenerationUpdate) -> StagedRetrievalTask | None:
        task_id = update.task_id
        if task_id in self._done:
            return None
        run = self._view.task(task_id)
        node = None if run is None else run.node
        if not isinstance(node, GenerationNode):
            return None
        # NOTE: the scheduler applies this update after the transforms: add it here
        num_tokens = run.num_tokens + len(update.new_token_ids)
        if num_tokens < self.fraction * node.max_tokens:
            return None
        self._done.add(task_id)
        # NOTE: the partial text as if it were the node's whole output (written the way the
        # final text will be, ``State.write``): the search only guesses the next clusters
        step = self._view.peek_next(run, run.partial_text + update.text_delta)
        if step is None or isinstance(step.node_id, tuple):
            return None
        target = run.graph.nodes.get(step.node_id)
        if not isinstance(target, RetrievalNode) or node.output not in target.inputs:
            return None
        if target.mode not in (None, "dense") or target.filter is not None:
            return None  # speculation reuses dense probe plans only
        spec_id = f"{PREFIX}{next(self._seq)}/{task_id}"
        self._pending[spec_id] = run.request_id
        self.num_issued += 1
        return StagedRetrievalTask(
            spec_id,
            target.query.render(step.state),
            target.topk,
            target.nprobe,
            collapse_sections=False,  # only its clusters warm the cache; passages unused
            request_id=run.request_id,
            cache_topk=self.similarity.cache_topk,
        )
