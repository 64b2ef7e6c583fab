"""Similarity-aware search (HedraRAG §4.3): a per-request local cache and cluster reordering.

Successive retrievals of one request tend to land in the same index regions. For each
retrieval of a request, the cache keeps the clusters holding its larger top-k (20) results
(``H_v``) and the clusters it probed (``C_v``). The request's next retrieval scans its own
probed clusters ``C'`` in the order::

    H_v ∩ C'   then   (C_v - H_v) ∩ C'   then   the rest of C'      (each group in coarse order)

Every cluster of ``C'`` is still scanned, so the final top-k is Faiss's; what changes is how
early the partial top-k (which speculative generation starts from) is already the final one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass

from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import (
    RetrievalResult,
    RetrievalTask,
    StagedRetrievalResult,
    StagedRetrievalTask,
    Wavefront,
)
from ragserve.scheduler.transforms import BaseTransform, SchedulerView

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEntry:
    """What one request's latest retrieval left behind."""

    hit_clusters: tuple[int, ...]
    probed_clusters: tuple[int, ...]


class LocalCache:
    """Per-request cache entries, bounded (least recently used requests dropped first)."""

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

    def drop(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)


class SimilarityTransform(BaseTransform):
    """Attach each request's local cache to its retrieval tasks; refresh it from the results.

    Needs ``bind(view)`` (the scheduler calls it) to map task ids to request ids.
    ``cache_topk`` is the larger top-k kept per retrieval (20 in the paper).
    """

    def __init__(self, cache_topk: int = 20, max_requests: int = 4096) -> None:
        self.cache_topk = cache_topk
        self.cache = LocalCache(max_requests)
        self._task_request: dict[str, str] = {}
        self.num_reordered = 0
        self._view: SchedulerView | None = None

    def bind(self, view: SchedulerView) -> None:
        self._view = view

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [self._rewrite(t) for t in wavefront.retrieval]
        return wavefront

    def _rewrite(self, task: RetrievalTask) -> RetrievalTask:
        rid = _request_id(self._view, task)
        if rid is None:
            return task
        self._task_request[task.task_id] = rid
        staged = as_staged(task, request_id=rid)
        entry = self.cache.get(rid)
        if entry is not None:
            self.num_reordered += 1
            staged = dataclasses.replace(
                staged,
                hit_clusters=entry.hit_clusters,
                previous_clusters=entry.probed_clusters,
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

    def warm(self, request_id: str, entry: CacheEntry) -> None:
        """Seed a request's cache (speculative retrieval does this from partial generations)."""
        self.cache.put(request_id, entry)


def as_staged(task: RetrievalTask, **changes) -> StagedRetrievalTask:
    """``task`` as a ``StagedRetrievalTask`` (fields it already has kept), with ``changes``."""
    if isinstance(task, StagedRetrievalTask):
        return dataclasses.replace(task, **changes) if changes else task
    base = {f.name: getattr(task, f.name) for f in dataclasses.fields(RetrievalTask)}
    return StagedRetrievalTask(**base, **changes)


def _request_id(view: SchedulerView | None, task: RetrievalTask) -> str | None:
    if isinstance(task, StagedRetrievalTask) and task.request_id is not None:
        return task.request_id
    run = view.task(task.task_id) if view is not None else None
    return None if run is None else run.request_id
