"""Messages of staged retrieval (a retrieval node cut into cluster sub-stages):
``StagedRetrievalTask`` (how to cut, which clusters first, whether to report partials), and
back ``RetrievalPartial`` (for the transforms only) and ``StagedRetrievalResult``."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.graph import Passage
from ragserve.scheduler.messages import RetrievalResult, RetrievalTask


@dataclass(frozen=True)
class StagedRetrievalTask(RetrievalTask):
    """A retrieval run in sub-stages of clusters.

    - ``split``: pack each sub-stage under the time budget ``mb`` (``budget_s``, or Eq. 1's
      optimum from the worker's measurements when ``None``); ``False``: one sub-stage.
    - ``first_clusters``: when > 0, the first sub-stage scans exactly this many clusters
      (an early partial result for speculation even without budget splitting).
    - ``hit_clusters`` / ``previous_clusters``: the request's local cache (HedraRAG §4.3):
      scan probed clusters in ``hit_clusters`` first, then those in ``previous_clusters``,
      then the rest (each group in coarse order). Exact: every probed cluster is scanned.
    - ``cache_topk``: also report the clusters of this many best results (the local cache).
    - ``emit_partials``: send a ``RetrievalPartial`` after every non-final sub-stage.
    """

    request_id: str | None = None
    split: bool = False
    budget_s: float | None = None
    first_clusters: int = 0
    hit_clusters: tuple[int, ...] = ()
    previous_clusters: tuple[int, ...] = ()
    cache_topk: int = 0
    emit_partials: bool = False


@dataclass(frozen=True)
class RetrievalPartial:
    """The top-k after ``num_substages`` sub-stages of a staged retrieval (not final)."""

    task_id: str
    passages: tuple[Passage, ...]
    num_substages: int
    finished: bool = False
    error: str | None = None


@dataclass(frozen=True)
class StagedRetrievalResult(RetrievalResult):
    """The final result plus the local-cache data and how the stage was cut.

    ``hit_clusters``: clusters holding the best ``cache_topk`` results; ``probed_clusters``:
    every cluster this retrieval scanned (coarse order); ``num_substages``: how many
    sub-stages it took; ``scan_seconds``: the scan time attributed to it.
    """

    hit_clusters: tuple[int, ...] = ()
    probed_clusters: tuple[int, ...] = ()
    num_substages: int = 1
    scan_seconds: float = 0.0
