"""Node splitting (HedraRAG §4.2): a retrieval node becomes sequential sub-stages of clusters.

The transform only marks retrieval tasks as staged; the cutting happens in the retrieval
worker's staged search (``ragserve.retrieval.staged``), which owns the measurements Eq. 1 needs.
Each sub-stage packs, for every active retrieval, clusters in scan
order until the time budget ``mb`` is reached, and all retrievals' sub-stages of one step go
to Faiss as one batch. Between sub-stages the worker admits new retrievals, so a short
retrieval no longer waits behind a long one, and reports partial top-k (for speculation).

```
unsplit:   R1 [=========== 64 clusters ===========]  R2 waits ........ [=== R2 ===]
split:     R1 [== mb ==][== mb ==][== mb ==][== mb ==] ...
           R2            [== mb ==][== mb ==] (joins at the next sub-stage boundary)
```

The merged top-k is identical to the unsplit search (``retrieval.stepwise`` merges partial
results under Faiss's order).

Generation nodes are split too (``gen_chunks``): a generation task gets ``chunk_s = mb``, and
the generation runner then reports it in chunks of decode steps of about ``mb`` each instead
of one update per token, so generation and retrieval sub-stages are of similar duration and
the scheduler runs a cycle per chunk rather than per token. With a fixed ``budget_s`` that is
``mb``; with Eq. 1 (``budget_s=None``) the budget lives in the retrieval worker, so the
transform learns it from the staged results: a split retrieval's ``scan_seconds /
num_substages`` is its mean sub-stage time, ``mb`` up to packing (each full sub-stage takes
clusters until ``mb`` is reached, the last one takes the remainder). Until a split result has
come back, generation tasks keep per-token updates.
"""

from __future__ import annotations

import dataclasses

from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import RetrievalResult, StagedRetrievalResult, Wavefront
from ragserve.scheduler.similarity import as_staged
from ragserve.scheduler.transforms import BaseTransform


class SplitTransform(BaseTransform):
    """Mark every retrieval task for sub-stage execution under the budget ``mb``; give
    generation tasks the chunk ``mb`` (``gen_chunks``; a task's own ``chunk_s`` is kept).

    ``budget_s=None``: the worker's Eq. 1 optimum from its measured mean stage time and
    per-sub-stage overhead (no split until both are measured); a number fixes ``mb``.
    ``learned_budget_s``: the ``mb`` estimated from split results (an exponential moving
    average with weight ``alpha`` on the newest), used for chunks when ``budget_s`` is None.
    """

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
        """The chunk given to generation tasks now (``None``: per-token updates)."""
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
