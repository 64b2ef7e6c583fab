"""Value types that cross the retrieval boundary: documents, probe plans, top-k, index spec."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np


@dataclass(frozen=True)
class Document:
    """One passage, the unit embedded, indexed and returned; upserting its `id` replaces it."""

    id: str
    text: str
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoredDocument:
    """A search hit: the document and its Faiss score (IP: similarity, L2: squared distance)."""

    document: Document
    score: float

    @property
    def id(self) -> str:
        return self.document.id

    @property
    def title(self) -> str | None:
        return self.document.title

    @property
    def text(self) -> str:
        return self.document.text


class ProbePlan(NamedTuple):
    """Each query's probed clusters, best first: `cluster_ids` int64 `[n, w]` (`-1` pads),
    `coarse_dists` float32 `[n, w]` (the quantizer's, which residual PQ/SQ scans need).

    ```
    plan (w = 8):  q0: c3 c9 c1 c7 | c2 c0 c5 c4     plan.columns(0, 4) -> first step
                   q1: c5 c3 c8 c2 | c6 c1 c0 c9     plan.columns(4, 8) -> second step
    ```
    """

    cluster_ids: np.ndarray
    coarse_dists: np.ndarray

    @property
    def num_queries(self) -> int:
        return int(self.cluster_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.cluster_ids.shape[1])

    def columns(self, start: int, stop: int) -> ProbePlan:
        """The probe ranks `[start, stop)` of every query (a step of a step-wise search)."""
        return ProbePlan(self.cluster_ids[:, start:stop], self.coarse_dists[:, start:stop])

    def rows(self, start: int, stop: int) -> ProbePlan:
        """The plan of queries `[start, stop)` (a sub-batch)."""
        return ProbePlan(self.cluster_ids[start:stop], self.coarse_dists[start:stop])

    def split(self, num_steps: int) -> list[ProbePlan]:
        """Cut the probe lists into `num_steps` contiguous column slices of near-equal width."""
        bounds = np.linspace(0, self.width, num_steps + 1).round().astype(int)
        return [self.columns(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False) if b > a]

    def take(self, ranks: np.ndarray) -> ProbePlan:
        """Per-query selection/reordering of probe ranks: `ranks` int `[n, w']`, `-1` = skip."""
        ranks = np.asarray(ranks, dtype=np.int64)
        rows = np.arange(self.num_queries)[:, None]
        safe = np.where(ranks < 0, 0, ranks)
        ids = np.where(ranks < 0, -1, self.cluster_ids[rows, safe])
        dists = np.where(ranks < 0, 0.0, self.coarse_dists[rows, safe]).astype(np.float32)
        return ProbePlan(ids, dists)


class TopK(NamedTuple):
    """Per-query results, best first: `ids` int64 `[n, k]` (`-1` = no result),
    `scores` float32 `[n, k]` (IP: higher is better; L2: squared distance, lower is better)."""

    ids: np.ndarray
    scores: np.ndarray


@dataclass(frozen=True)
class IndexSpec:
    """What an index is: fixed at build time, recorded in the manifest."""

    dim: int
    nlist: int
    kind: str = "ivf_flat"
    metric: str = "ip"
    embedder: str = "all-minilm-l6-v2"
    nprobe: int = 1  # default probe width when a search does not name one

    @property
    def is_l2(self) -> bool:
        return self.metric == "l2"


def auto_nlist(num_vectors: int) -> int:
    """About 4·sqrt(n) clusters, but at least 39 training points per cluster."""
    return max(1, min(int(4 * math.sqrt(num_vectors)), num_vectors // 39))


class ScanIndex(Protocol):
    """What the timing code needs of an index (`VectorIndex` is one)."""

    @property
    def nlist(self) -> int: ...

    def assign(self, queries: np.ndarray, nprobe: int | None = None) -> ProbePlan: ...

    def scan(
        self, queries: np.ndarray, cluster_ids_per_query: Any, topk: int, state: Any = None
    ) -> TopK: ...
