"""Node splitting (HedraRAG §4.2): retrieval tasks are marked to run in sub-stages of clusters
under the time budget ``mb`` (the cutting is ``retrieval.staged``'s, exact), and generation
tasks report in chunks of about ``mb`` of decode steps (``chunk_s``)."""

from __future__ import annotations

import dataclasses

from ragserve.scheduler.messages import (
    RetrievalResult,
    StagedRetrievalResult,
    Update,
    Wavefront,
    as_staged,
)
from ragserve.scheduler.transforms import BaseTransform


class SplitTransform(BaseTransform):
    """``budget_s`` fixes ``mb`` (None: the worker's Eq. 1 optimum). With ``gen_chunks``,
    generation tasks without their own ``chunk_s`` get ``mb``: ``budget_s``, else
    ``learned_budget_s``, the moving average (weight ``alpha``) of split results' sub-stage
    time (per-token updates until one is known)."""

    def __init__(
        self, budget_s: float | None = None, *, gen_chunks: bool = True, alpha: float = 0.2
    ) -> None:
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 or None, got {budget_s}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.budget_s = budget_s
        self.gen_chunks = gen_chunks
        self.alpha = alpha
        self.learned_budget_s: float | None = None
        self._split_ids: set[str] = set()  # retrieval tasks marked here, until their result

    @property
    def chunk_s(self) -> float | None:
        if not self.gen_chunks:
            return None
        return self.budget_s if self.budget_s is not None else self.learned_budget_s

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [
            as_staged(t, split=True, budget_s=self.budget_s) for t in wavefront.retrieval
        ]
        self._split_ids.update(t.task_id for t in wavefront.retrieval)
        chunk = self.chunk_s
        if chunk is not None:
            wavefront.generation = [
                t if t.chunk_s is not None else dataclasses.replace(t, chunk_s=chunk)
                for t in wavefront.generation
            ]
        return wavefront

    def on_updates(self, updates: list[Update]) -> list[Update]:
        for u in updates:
            if not isinstance(u, RetrievalResult) or u.task_id not in self._split_ids:
                continue
            self._split_ids.discard(u.task_id)
            if isinstance(u, StagedRetrievalResult) and u.error is None:
                self._learn(u)
        return updates

    def _learn(self, result: StagedRetrievalResult) -> None:
        if result.num_substages < 2 or result.scan_seconds <= 0:
            return  # not cut: says nothing about mb
        mb = result.scan_seconds / result.num_substages
        old = self.learned_budget_s
        self.learned_budget_s = mb if old is None else (1 - self.alpha) * old + self.alpha * mb
