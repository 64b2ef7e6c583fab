"""Similarity-aware search (HedraRAG §4.3): each request's local cache of the clusters its last
retrieval hit (``H_v``) and probed (``C_v``), so its next retrieval scans ``H_v`` first, then
``C_v``, then the rest. Every probed cluster is still scanned: the top-k stays Faiss's.

``SimilarityTransform`` fills the cache from retrieval results; ``SpeculativeRetrievalTransform``
warms it early, searching with a generation's partial text when the next node retrieves with it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from ragserve.graph import GenerationNode, RetrievalNode
from ragserve.scheduler.messages import (
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
    StagedRetrievalResult,
    StagedRetrievalTask,
    Update,
    Wavefront,
    as_staged,
)
from ragserve.scheduler.transforms import BaseTransform

SPEC_PREFIX = "specret/"  # task ids of speculative retrievals


@dataclass(frozen=True)
class CacheEntry:
    hit_clusters: tuple[int, ...]
    probed_clusters: tuple[int, ...]


class LocalCache:
    """Request id -> its latest ``CacheEntry``; least recently used requests dropped first."""

    def __init__(self, max_requests: int = 4096) -> None:
        self.max_requests = max_requests
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def get(self, request_id: str) -> CacheEntry | None:
        entry = self._entries.get(request_id)
        if entry is not None:
            self._entries.move_to_end(request_id)
        return entry

    def put(self, request_id: str, entry: CacheEntry) -> None:
        self._entries[request_id] = entry
        self._entries.move_to_end(request_id)
        while len(self._entries) > self.max_requests:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class SimilarityTransform(BaseTransform):
    """Attach each request's cache entry to its retrieval tasks; refresh it from the results
    (``cache_topk``: how many best results' clusters are kept, 20 in the paper)."""

    def __init__(self, cache_topk: int = 20, max_requests: int = 4096) -> None:
        self.cache_topk = cache_topk
        self.cache = LocalCache(max_requests)
        self._task_request: dict[str, str] = {}
        self.num_reordered = 0

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [self._rewrite(t) for t in wavefront.retrieval]
        return wavefront

    def _rewrite(self, task: RetrievalTask) -> RetrievalTask:
        rid = getattr(task, "request_id", None)
        if rid is None:
            run = self.view.task(task.task_id) if self.view is not None else None
            if run is None:
                return task
            rid = run.request_id
        self._task_request[task.task_id] = rid
        staged = as_staged(task, request_id=rid)
        entry = self.cache.get(rid)
        if entry is not None:
            self.num_reordered += 1
            staged = dataclasses.replace(
                staged, hit_clusters=entry.hit_clusters, previous_clusters=entry.probed_clusters
            )
        return dataclasses.replace(staged, cache_topk=max(staged.cache_topk, self.cache_topk))

    def on_updates(self, updates: list[Update]) -> list[Update]:
        for u in updates:
            rid = (
                self._task_request.pop(u.task_id, None) if isinstance(u, RetrievalResult) else None
            )
            if rid is not None and isinstance(u, StagedRetrievalResult) and u.error is None:
                self.cache.put(rid, CacheEntry(u.hit_clusters, u.probed_clusters))
        return updates


class SpeculativeRetrievalTransform(BaseTransform):
    """Once a generation has ``fraction`` of its ``max_tokens``, and the node after it is a
    dense retrieval reading its output, search once with the partial text and warm
    ``similarity``'s cache with the result (never seen by the scheduler)."""

    needs_partial_updates = True  # it fires on a partial text

    def __init__(self, similarity: SimilarityTransform, fraction: float = 0.5) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.similarity = similarity
        self.fraction = fraction
        self.num_issued = 0
        self.num_warmed = 0
        self._done: set[str] = set()  # generation task ids already handled
        self._pending: dict[str, str] = {}  # speculative task id -> request id
        self._seq = itertools.count()

    def apply(self, wavefront: Wavefront) -> Wavefront:
        return wavefront

    def on_updates(self, updates: list[Update]) -> list[Update]:
        out: list[Update] = []
        issue: list[StagedRetrievalTask] = []
        for u in updates:
            if u.task_id in self._pending:
                rid = self._pending.pop(u.task_id)
                if isinstance(u, StagedRetrievalResult) and u.error is None:
                    self.similarity.cache.put(rid, CacheEntry(u.hit_clusters, u.probed_clusters))
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
            self.view.submit_retrieval(issue)
        return out

    def _maybe_issue(self, update: GenerationUpdate) -> StagedRetrievalTask | None:
        task_id = update.task_id
        run = None if task_id in self._done else self.view.task(task_id)
        if run is None or not isinstance(run.node, GenerationNode):
            return None
        node = run.node
        # NOTE: the scheduler applies this update after the transforms: add it here
        if run.num_tokens + len(update.new_token_ids) < self.fraction * node.max_tokens:
            return None
        self._done.add(task_id)
        step = self.view.peek_next(run, run.partial_text + update.text_delta)
        if step is None or isinstance(step.node_id, tuple):
            return None
        target = run.graph.nodes.get(step.node_id)
        if not isinstance(target, RetrievalNode) or node.output not in target.inputs:
            return None
        if target.mode not in (None, "dense") or target.filter is not None:
            return None  # speculation reuses dense probe plans only
        spec_id = f"{SPEC_PREFIX}{next(self._seq)}/{task_id}"
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
