"""`ShardedIndex`: the `VectorIndex` search and upsert API over shard folders (docs/scale_out.md).
Queries are assigned once here; each shard scans its part of the plan and the partial top-k
are merged (`stepwise.merge`): the source index's result, exactly.
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

import ragserve.retrieval.stepwise as stepwise
from ragserve.retrieval.cold_stream import StreamConfig
from ragserve.retrieval.embedder import IndexEncoderMixin
from ragserve.retrieval.index import IndexSpec, VectorIndex
from ragserve.retrieval.index_tier import TierSpec, check_tier_options
from ragserve.retrieval.passages import passage_text
from ragserve.retrieval.shard_split import QUANTIZER, ShardLayout, read_layout
from ragserve.retrieval.types import Document, ProbePlan, TopK

TIER_REFRESH_S = 1.0  # how stale `ShardedIndex`'s view of the shards' tiers may get


class ShardServer:
    """One shard folder as a `VectorIndex`, with the methods a `ShardedIndex` calls; ``tier``
    is placed at start (so an actor restarted from its folder gets it back)."""

    def __init__(self, directory: str | Path, tier: TierSpec | None = None) -> None:
        self.index = VectorIndex.load(directory)
        self.num_scans = 0
        self.num_scanned_clusters = 0
        if tier is not None:
            tier.place(self.index)

    def spec(self) -> IndexSpec:
        return self.index.spec

    def scan(self, queries: np.ndarray, plan: ProbePlan, topk: int) -> TopK:
        self.num_scans += 1
        self.num_scanned_clusters += int((plan.cluster_ids >= 0).sum())
        if not queries.flags.writeable:  # NOTE: from Ray's object store; torch wants writable
            queries = queries.copy()
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
        return self.index.clusters_of(ids)

    def check_integrity(self) -> None:
        self.index.check_integrity()

    def set_gpu_tier(self, budget_bytes: int, options: dict[str, Any]) -> dict[str, Any]:
        self.index.set_gpu_tier(int(budget_bytes), **options)
        return self.tier_state()

    def drop_gpu_tier(self) -> None:
        self.index.drop_gpu_tier()

    def tier_state(self) -> dict[str, Any] | None:
        tier = self.index.gpu_tier
        if tier is None:
            return None
        return {
            "clusters": np.asarray(tier.clusters, dtype=np.int64),
            "num_bytes": int(tier.num_bytes),
            "hit_rate": float(tier.hit_rate),
            "device": tier.device,
        }

    def stats(self) -> dict[str, Any]:
        tier = self.index.gpu_tier
        return {
            "num_documents": self.index.num_documents,
            "num_scans": self.num_scans,
            "num_scanned_clusters": self.num_scanned_clusters,
            "tier_clusters": 0 if tier is None else len(tier.clusters),
            "tier_bytes": 0 if tier is None else int(tier.num_bytes),
        }

    def close(self) -> None:
        self.index.close()


@dataclass(frozen=True)
class ShardedTier:
    """The shards' tiers as one: ``clusters`` served from a tier on every shard holding part
    of them, bytes summed, mean ``hit_rate``, the first shard's ``device``, ``shards`` holding
    one."""

    clusters: tuple[int, ...]
    num_bytes: int
    hit_rate: float
    device: str
    shards: int

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        cids = np.asarray(cluster_ids)
        return (cids >= 0) & np.isin(cids, np.asarray(self.clusters, dtype=np.int64))


class BaseShard(ABC):
    """``submit(method, *args)`` starts a `ShardServer` call and returns a callable waiting for
    its result; ``idempotent`` calls may be retried once by a handle whose shard restarted."""

    @abstractmethod
    def submit(self, method: str, *args: Any, idempotent: bool = True) -> Any: ...

    def call(self, method: str, *args: Any, idempotent: bool = True) -> Any:
        return self.submit(method, *args, idempotent=idempotent)()


class LocalShard(BaseShard):
    def __init__(self, server: ShardServer) -> None:
        self.server = server

    def submit(self, method: str, *args: Any, idempotent: bool = True) -> Any:
        done: Future = Future()
        try:
            done.set_result(getattr(self.server, method)(*args))
        except Exception as exc:  # noqa: BLE001 - raised by the waiter, as a remote shard's
            done.set_exception(exc)
        return done.result


class ShardedIndex(IndexEncoderMixin):
    """The `VectorIndex` API a runner uses, over ``shards``: writes go to the owning shard
    (and are durable there on return; the only writer of its shards); searches may run
    concurrently with writes."""

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
        self._embedder_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sizes: np.ndarray | None = None  # cached; reset by writes through this object
        self._tier: ShardedTier | None = None
        self._tier_read_at: float | None = None  # monotonic time of the last tier read

    @classmethod
    def open_local(cls, root: str | Path, *, embedder: Any = None) -> ShardedIndex:
        root = Path(root)
        layout = read_layout(root)
        shards = [
            LocalShard(ShardServer(layout.shard_dir(root, i))) for i in range(layout.num_shards)
        ]
        return cls(shards, layout, read_quantizer(root), embedder=embedder)

    def assign(self, queries: np.ndarray, nprobe: int | None = None) -> ProbePlan:
        return stepwise.assign(self.quantizer, queries, nprobe or self.spec.nprobe)

    def scan(
        self, queries: np.ndarray, plan: ProbePlan, topk: int, state: TopK | None = None
    ) -> TopK:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        waits = [s.submit("scan", q, p, topk) for s, p in self.fan_out(plan)]
        for wait in waits:
            state = stepwise.merge(state, wait(), self.spec.is_l2)
        return state if state is not None else stepwise.empty_topk(len(q), topk, self.spec.is_l2)

    def search(self, queries: np.ndarray, topk: int, nprobe: int | None = None) -> TopK:
        return self.scan(queries, self.assign(queries, nprobe), topk)

    def fan_out(self, plan: ProbePlan) -> list[tuple[BaseShard, ProbePlan]]:
        """The shards ``plan`` touches, each with its part (others' clusters ``-1``)."""
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

    def get_documents(self, ids: Sequence[int | str]) -> list[Document | None]:
        keys = list(ids)
        found: list[Document | None] = [None] * len(keys)
        for part in self._on_all("get_documents", keys):
            found = [f if f is not None else d for f, d in zip(found, part, strict=True)]
        return found

    def add_documents(self, docs: Sequence[Document], vectors: np.ndarray | None = None) -> None:
        docs = list(docs)
        if not docs:
            return
        x = self._upsert_vectors(docs, vectors, passage_text)
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

    def cluster_sizes(self) -> np.ndarray:
        sizes = self._sizes
        if sizes is None:
            sizes = sum(self._on_all("cluster_sizes"))
            self._sizes = sizes
        return sizes

    @property
    def num_documents(self) -> int:
        return int(self.cluster_sizes().sum())

    def set_gpu_tier(
        self,
        budget_bytes: int,
        *,
        device: str = "cuda",
        dtype: str = "float32",
        scan: str = "auto",
        stream_cold: str | StreamConfig = "auto",
    ) -> ShardedTier | None:
        """A tier on every shard within ``shard_tier_budget(budget_bytes, M)``, options as
        ``VectorIndex.set_gpu_tier`` (checked here first); exact."""
        check_tier_options(self.spec.kind, budget_bytes, scan, stream_cold)
        share = shard_tier_budget(budget_bytes, len(self.shards))
        options = {"device": device, "dtype": dtype, "scan": scan, "stream_cold": stream_cold}
        self._on_all("set_gpu_tier", share, options)
        return self._refresh_tier()

    def drop_gpu_tier(self) -> None:
        self._on_all("drop_gpu_tier")
        self._refresh_tier()

    @property
    def gpu_tier(self) -> ShardedTier | None:
        read_at = self._tier_read_at
        if read_at is None or time.monotonic() - read_at > TIER_REFRESH_S:
            return self._refresh_tier()
        return self._tier

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        """bool like ``cluster_ids``: lists served from tiers (a cost hint only)."""
        tier = self.gpu_tier
        if tier is None:
            return np.zeros(np.shape(cluster_ids), dtype=bool)
        return tier.resident_mask(cluster_ids)

    def _refresh_tier(self) -> ShardedTier | None:
        states = self._on_all("tier_state")
        self._tier_read_at = time.monotonic()
        held = [st for st in states if st is not None]
        if not held:
            self._tier = None
            return None
        sets = [np.asarray(st["clusters"], dtype=np.int64) for st in held]
        if self.layout.partition == "list":  # each list lives on one shard: its owner's tier
            resident = np.unique(np.concatenate(sets))
        elif len(held) < len(states):  # a shard without a tier scans every list
            resident = np.zeros(0, np.int64)
        else:
            resident = functools.reduce(np.intersect1d, sets)
        self._tier = ShardedTier(
            clusters=tuple(int(c) for c in resident),
            num_bytes=sum(int(st["num_bytes"]) for st in held),
            hit_rate=float(np.mean([st["hit_rate"] for st in held])),
            device=str(held[0]["device"]),
            shards=len(held),
        )
        return self._tier

    def search_text(self, texts: Sequence[str], topk: int, **kwargs: Any) -> list:
        raise ValueError(
            "mode/filter: BM25, hybrid and filtered search are not built for a sharded index "
            "yet; use mode='dense' without a filter"
        )

    def clusters_of(self, ids: np.ndarray) -> np.ndarray:
        out = np.full(len(ids), -1, np.int64)
        for part in self._on_all("clusters_of", ids):
            out = np.where(out < 0, part, out)
        return out

    def check_integrity(self) -> None:
        self._on_all("check_integrity")

    def shard_stats(self) -> list[dict[str, int]]:
        return self._on_all("stats")

    def _on_all(self, method: str, *args: Any) -> list:
        """`method(*args)` on every shard at once; the results in shard order."""
        return [wait() for wait in [s.submit(method, *args) for s in self.shards]]


def shard_tier_budget(budget_bytes: int, num_shards: int) -> int:
    """One shard's part of a tier budget: an even split (shards are balanced by size)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | np.integer):
        raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return int(budget_bytes) // num_shards


def read_quantizer(root: str | Path) -> faiss.Index:
    return faiss.read_index(str(Path(root) / QUANTIZER))
