"""`ShardedIndex`: the `VectorIndex` search and upsert API over shard folders (`shard_split.py`).

```
              assign (shared quantizer, once)
queries ──> ProbePlan [n, w] ──┬─ shard 0: its columns (list) / all (document) ─ scan ─┐
                               └─ shard 1: ...                                  ─ scan ─┴─ merge
```

Assignment happens here once; each shard scans the plan's clusters it holds (pads `-1`) and
the partial top-k are merged with `stepwise.merge`, so any step-wise slicing of the plan gives
the source index's one-shot result (same ids, same scores). A shard is reached through a
`BaseShard` (in process: `LocalShard`; across processes: the Ray backend's actor client), which
runs a `ShardServer` over one shard folder.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ragserve.retrieval import stepwise
from ragserve.retrieval.index import IndexSpec, VectorIndex
from ragserve.retrieval.shard_split import QUANTIZER, ShardLayout, cluster_map, read_layout
from ragserve.retrieval.types import Document, ProbePlan, TopK

logger = logging.getLogger(__name__)


class ShardServer:
    """One shard folder opened as a `VectorIndex`; the methods a `ShardedIndex` calls."""

    def __init__(self, directory: str | Path) -> None:
        self.index = VectorIndex.load(directory)
        self.num_scans = 0
        self.num_scanned_clusters = 0

    def spec(self) -> IndexSpec:
        return self.index.spec

    def scan(self, queries: np.ndarray, plan: ProbePlan, topk: int) -> TopK:
        self.num_scans += 1
        self.num_scanned_clusters += int((plan.cluster_ids >= 0).sum())
        return self.index.scan(queries, plan, topk)

    def get_documents(self, ids: list[int | str]) -> list[Document | None]:
        return self.index.get_documents(ids)

    def add_documents(self, docs: list[Document], vectors: np.ndarray) -> None:
        self.index.add_documents(docs, vectors)

    def delete_documents(self, doc_ids: list[str]) -> int:
        return self.index.delete_documents(doc_ids)

    def cluster_sizes(self) -> np.ndarray:
        return self.index.cluster_sizes()

    def clusters_of(self, ids: np.ndarray) -> np.ndarray:
        """The list of each row id held here, ``-1`` for the others."""
        with self.index._rw.read():
            cmap = cluster_map(self.index.faiss_index)
        ids = np.asarray(ids, dtype=np.int64)
        inside = (ids >= 0) & (ids < len(cmap))
        return np.where(inside, cmap[np.where(inside, ids, 0)], -1)

    def check_integrity(self) -> None:
        self.index.check_integrity()

    def stats(self) -> dict[str, int]:
        return {
            "num_documents": self.index.num_documents,
            "num_scans": self.num_scans,
            "num_scanned_clusters": self.num_scanned_clusters,
        }

    def close(self) -> None:
        self.index.close()


class BaseShard(ABC):
    """Handle of one shard: ``submit(method, *args)`` starts a `ShardServer` call and returns
    a zero-argument callable that waits for its result (raising its error). ``idempotent``
    calls (searches, reads) may be retried once by a handle whose shard died and restarted."""

    @abstractmethod
    def submit(self, method: str, *args: Any, idempotent: bool = True) -> Any: ...

    def call(self, method: str, *args: Any, idempotent: bool = True) -> Any:
        return self.submit(method, *args, idempotent=idempotent)()


class LocalShard(BaseShard):
    """A `ShardServer` in this process (tests; single-process sharding)."""

    def __init__(self, server: ShardServer) -> None:
        self.server = server

    def submit(self, method: str, *args: Any, idempotent: bool = True) -> Any:
        try:
            value = getattr(self.server, method)(*args)
        except Exception as exc:
            error = exc

            def fail() -> Any:
                raise error

            return fail
        return lambda: value


class ShardedIndex:
    """The `VectorIndex` API a retrieval runner uses, over ``shards`` laid out by ``layout``.

    Writes go to the owning shard (``"list"``: the owner of the vector's list, and the doc id
    is deleted from the other shards in case an update moved it; ``"document"``: the shard its
    id hashes to) and are durable there before they return; one `ShardedIndex` is the only
    writer of its shards. Searches may run concurrently with writes from other threads.
    """

    def __init__(
        self,
        shards: Sequence[BaseShard],
        layout: ShardLayout,
        quantizer: faiss.Index,
        *,
        embedder: Any = None,
    ) -> None:
        if len(shards) != layout.num_shards:
            raise ValueError(f"layout has {layout.num_shards} shards, got {len(shards)} handles")
        self.shards = list(shards)
        self.layout = layout
        self.quantizer = quantizer
        self.spec: IndexSpec = self.shards[0].call("spec")
        self._embedder = embedder
        self._lock = threading.Lock()
        self._sizes: np.ndarray | None = None  # cached; reset by writes through this object

    @classmethod
    def open_local(cls, root: str | Path, *, embedder: Any = None) -> ShardedIndex:
        """All shards of ``root`` in this process."""
        root = Path(root)
        layout = read_layout(root)
        shards = [
            LocalShard(ShardServer(layout.shard_dir(root, i))) for i in range(layout.num_shards)
        ]
        return cls(shards, layout, read_quantizer(root), embedder=embedder)

    # -- search -----------------------------------------------------------------------------
    def assign(self, queries: np.ndarray, nprobe: int | None = None) -> ProbePlan:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.spec.dim:
            raise ValueError(f"queries must have shape [n, {self.spec.dim}], got {q.shape}")
        width = max(1, min(int(nprobe or self.spec.nprobe), self.spec.nlist))
        dists, ids = self.quantizer.search(q, width)
        return ProbePlan(ids.astype(np.int64, copy=False), dists.astype(np.float32, copy=False))

    def scan(
        self, queries: np.ndarray, plan: ProbePlan, topk: int, state: TopK | None = None
    ) -> TopK:
        """Scan ``plan``'s clusters on the shards holding them; merged into ``state``."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        waits = [s.submit("scan", q, p, topk) for s, p in self.fan_out(plan)]
        parts = [w() for w in waits]
        for part in parts:
            state = stepwise.merge(state, part, self.spec.is_l2)
        return state if state is not None else stepwise.empty_topk(len(q), topk, self.spec.is_l2)

    def search(self, queries: np.ndarray, topk: int, nprobe: int | None = None) -> TopK:
        return self.scan(queries, self.assign(queries, nprobe), topk)

    def fan_out(self, plan: ProbePlan) -> list[tuple[BaseShard, ProbePlan]]:
        """The shards ``plan`` touches, each with its part (other shards' clusters ``-1``)."""
        if self.layout.partition == "document":
            return [(s, plan) for s in self.shards]
        owners = self.layout.owners_of_clusters(plan.cluster_ids)
        out = []
        for i, shard in enumerate(self.shards):
            mine = owners == i
            if mine.any():
                cids = np.where(mine, plan.cluster_ids, -1)
                out.append((shard, ProbePlan(cids, np.where(mine, plan.coarse_dists, 0))))
        return out

    # -- documents --------------------------------------------------------------------------
    def get_documents(self, ids: Sequence[int | str]) -> list[Document | None]:
        keys = list(ids)
        found: list[Document | None] = [None] * len(keys)
        for part in [w() for w in [s.submit("get_documents", keys) for s in self.shards]]:
            found = [f if f is not None else d for f, d in zip(found, part, strict=True)]
        return found

    def add_documents(self, docs: Sequence[Document], vectors: np.ndarray | None = None) -> None:
        docs = list(docs)
        if not docs:
            return
        if len({d.id for d in docs}) != len(docs):
            raise ValueError("document ids in one add_documents call must be unique")
        if vectors is None:
            from ragserve.retrieval.index import _passage_text

            vectors = self.embedder.encode([_passage_text(d) for d in docs], is_query=False)
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        if x.shape != (len(docs), self.spec.dim):
            raise ValueError(f"vectors must have shape ({len(docs)}, {self.spec.dim})")
        owners = self._owners(docs, x)
        with self._lock:
            self._sizes = None
            for i, shard in enumerate(self.shards):
                rows = np.flatnonzero(owners == i)
                if len(rows):
                    shard.call("add_documents", [docs[r] for r in rows], x[rows], idempotent=False)
            if self.layout.partition == "list":  # an update may have moved a document's list
                for i, shard in enumerate(self.shards):
                    moved = [d.id for d, o in zip(docs, owners, strict=True) if o != i]
                    if moved:
                        shard.call("delete_documents", moved, idempotent=False)

    def delete_documents(self, doc_ids: Sequence[str]) -> int:
        ids = list(doc_ids)
        with self._lock:
            self._sizes = None
            if self.layout.partition == "list":
                targets = [(s, ids) for s in self.shards]
            else:
                targets = [
                    (s, [d for d in ids if self.layout.owner_of_document(d) == i])
                    for i, s in enumerate(self.shards)
                ]
            return sum(s.call("delete_documents", part, idempotent=False) for s, part in targets)

    def _owners(self, docs: list[Document], x: np.ndarray) -> np.ndarray:
        if self.layout.partition == "document":
            return np.array([self.layout.owner_of_document(d.id) for d in docs], dtype=np.int64)
        _, lists = self.quantizer.search(x, 1)
        return self.layout.owners_of_clusters(lists[:, 0].astype(np.int64))

    # -- metadata ---------------------------------------------------------------------------
    def cluster_sizes(self) -> np.ndarray:
        sizes = self._sizes
        if sizes is None:
            sizes = sum(w() for w in [s.submit("cluster_sizes") for s in self.shards])
            self._sizes = sizes
        return sizes

    @property
    def num_documents(self) -> int:
        return int(self.cluster_sizes().sum())

    # NOTE: no GPU tier on shards yet (issue 10's tier lives in one ``VectorIndex``): every
    # list is scanned by its shard on the CPU.
    gpu_tier = None

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        """No list is GPU-resident (all False), as ``VectorIndex.resident_mask`` without a tier."""
        return np.zeros(np.shape(cluster_ids), dtype=bool)

    def search_text(self, texts: Sequence[str], topk: int, **kwargs: Any) -> list:
        """Text search with a ``mode`` or ``filter`` is not built for sharded indexes yet."""
        raise ValueError(
            "mode/filter: BM25, hybrid and filtered search are not built for a sharded index "
            "yet; use mode='dense' without a filter"
        )

    def clusters_of(self, ids: np.ndarray) -> np.ndarray:
        """The inverted list of each row id (``-1`` where no shard holds it)."""
        out = np.full(len(ids), -1, np.int64)
        for part in [w() for w in [s.submit("clusters_of", ids) for s in self.shards]]:
            out = np.where(out < 0, part, out)
        return out

    def check_integrity(self) -> None:
        for s in self.shards:
            s.call("check_integrity")

    def shard_stats(self) -> list[dict[str, int]]:
        return [s.call("stats") for s in self.shards]

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from ragserve.retrieval.embedder import load_embedder

            self._embedder = load_embedder(self.spec.embedder)
        return self._embedder

    @property
    def embedder_name(self) -> str:
        return self.spec.embedder

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def nlist(self) -> int:
        return self.spec.nlist


def read_quantizer(root: str | Path) -> faiss.Index:
    return faiss.read_index(str(Path(root) / QUANTIZER))
