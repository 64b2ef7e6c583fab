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
from typing import Any

from ragserve.graph import END, GenerationNode, RetrievalNode, State
from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import GenerationUpdate, Wavefront
from ragserve.scheduler.similarity import CacheEntry, SimilarityTransform
from ragserve.scheduler.staged_messages import StagedRetrievalResult, StagedRetrievalTask
from ragserve.scheduler.transforms import BaseTransform

PREFIX = "specret/"


class SpeculativeRetrievalTransform(BaseTransform):
    """Issue one speculative retrieval per generation run once ``fraction`` of its
    ``max_tokens`` exist, if the node after it is a retrieval reading its output."""

    def __init__(self, similarity: SimilarityTransform, fraction: float = 0.5) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.similarity = similarity
        self.fraction = fraction
        self.num_issued = 0
        self.num_warmed = 0
        self._scheduler: Any = None
        self._done: set[str] = set()  # generation task ids already handled
        self._pending: dict[str, str] = {}  # speculative task id -> request id
        self._seq = itertools.count()

    def bind(self, scheduler: Any) -> None:
        self._scheduler = scheduler

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
            self._scheduler.executor.submit_retrieval(issue)
        return out

    def _maybe_issue(self, update: GenerationUpdate) -> StagedRetrievalTask | None:
        task_id = update.task_id
        if task_id in self._done:
            return None
        req = self._scheduler.request_of_task(task_id)
        node = None if req is None else req.graph.nodes.get(req.node_id)
        if not isinstance(node, GenerationNode) or req.raw_params is not None:
            return None
        # NOTE: the scheduler applies this update after the transforms: add it here
        num_tokens = req.timings[-1].num_tokens + len(update.new_token_ids)
        if num_tokens < self.fraction * node.max_tokens:
            return None
        self._done.add(task_id)
        state = State(req.state)
        state.visits = dict(req.state.visits)
        state[node.output] = req.partial_text + update.text_delta
        state.visits[req.node_id] = state.visit_count(req.node_id) + 1
        try:
            nxt = req.graph.next_node(req.node_id, state)
        except Exception:
            return None
        target = req.graph.nodes.get(nxt) if nxt is not END else None
        if not isinstance(target, RetrievalNode) or node.output not in target.inputs:
            return None
        if target.mode not in (None, "dense") or target.filter is not None:
            return None  # speculation reuses dense probe plans only
        spec_id = f"{PREFIX}{next(self._seq)}/{task_id}"
        self._pending[spec_id] = req.request_id
        self.num_issued += 1
        return StagedRetrievalTask(
            spec_id,
            target.query.render(state),
            target.topk,
            target.nprobe,
            request_id=req.request_id,
            cache_topk=self.similarity.cache_topk,
        )
