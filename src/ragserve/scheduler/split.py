"""Node splitting (HedraRAG §4.2): a retrieval node becomes sequential sub-stages of clusters.

The transform only marks retrieval tasks as staged; the cutting happens in the retrieval
worker (``ragserve.runtime.staged_retrieval``), which owns the measurements Eq. 1 needs
(``scheduler.cost_model``). Each sub-stage packs, for every active retrieval, clusters in scan
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
"""

from __future__ import annotations

from ragserve.scheduler.messages import Wavefront
from ragserve.scheduler.similarity import as_staged
from ragserve.scheduler.transforms import BaseTransform


class SplitTransform(BaseTransform):
    """Mark every retrieval task for sub-stage execution under the budget ``mb``.

    ``budget_s=None``: the worker's Eq. 1 optimum from its measured mean stage time and
    per-sub-stage overhead (no split until both are measured); a number fixes ``mb``.
    """

    def __init__(self, budget_s: float | None = None) -> None:
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 or None, got {budget_s}")
        self.budget_s = budget_s

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [
            as_staged(t, split=True, budget_s=self.budget_s) for t in wavefront.retrieval
        ]
        return wavefront
