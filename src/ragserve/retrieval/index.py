"""`VectorIndex`: a Faiss IVF index over a document store, with step-wise search and durable
online upserts. Searches take a shared lock; the Faiss index changes under an exclusive lock,
only after the store committed; writers are serialised, so the log order is the applied order.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

import ragserve.retrieval.stepwise as stepwise
from ragserve.retrieval.docstore import DocStore
from ragserve.retrieval.embedder import Embedder, IndexEncoderMixin
from ragserve.retrieval.ensemble import EnsembleMixin
from ragserve.retrieval.index_tier import GpuTierMixin
from ragserve.retrieval.modes import SearchModesMixin
from ragserve.retrieval.partition import AccessCounts
from ragserve.retrieval.passages import PassageMixin, check_header, passage_text
from ragserve.retrieval.persist import PersistMixin
from ragserve.retrieval.types import (
    Document,
    IndexSpec,
    ProbePlan,
    ScoredDocument,
    TopK,
    auto_nlist,
)

if TYPE_CHECKING:
    from ragserve.retrieval.bm25 import BM25Index
    from ragserve.retrieval.gpu_tier import GpuTier
    from ragserve.retrieval.partition import TierUpdater


class RWLock:
    """Many concurrent searches, one exclusive index mutation. Writer-preferring: once a writer
    waits, new readers queue behind it (no starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class IdLists:
    """Row id -> inverted list of an IVF index, sparse (row ids need not be dense: upserts,
    deletes and shards keep the whole index's ids): sorted ids and their lists, looked up with
    ``searchsorted``, so memory is proportional to the rows held."""

    ids: np.ndarray  # int64, sorted ascending
    lists: np.ndarray  # int64, the list of ``ids[i]``

    @classmethod
    def of(cls, ivf: faiss.IndexIVF) -> IdLists:
        """The map of ``ivf``'s rows (the caller keeps the index unchanged meanwhile)."""
        sizes = [ivf.invlists.list_size(c) for c in range(ivf.nlist)]
        ids = [faiss.rev_swig_ptr(ivf.invlists.get_ids(c), n) for c, n in enumerate(sizes) if n]
        all_ids = np.concatenate([np.zeros(0, np.int64), *ids]).astype(np.int64)
        all_lists = np.repeat(np.arange(ivf.nlist, dtype=np.int64), sizes)
        order = np.argsort(all_ids, kind="stable")
        return cls(all_ids[order], all_lists[order])

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """int64: the list of each id, ``-1`` for ids not held."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self.ids):
            return np.full(ids.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, self.lists[pos], -1)


class VectorIndex(
    GpuTierMixin, EnsembleMixin, PassageMixin, SearchModesMixin, PersistMixin, IndexEncoderMixin
):
    """Documents embedded into a Faiss IVF index (IVF-Flat, SQ8 or PQ; IP or L2). `TopK` ids
    are Faiss row ids (never reused). After `save(dir)` every write is durable in `dir` before
    it returns."""

    def __init__(
        self,
        index: faiss.IndexIVF,
        store: DocStore,
        spec: IndexSpec,
        *,
        embedder: Embedder | None = None,
        directory: Path | None = None,
    ) -> None:
        self._index = index
        self._store = store
        self.spec = spec
        self.directory = directory
        self._embedder = embedder
        self._embedder_lock = threading.Lock()
        self._rw = RWLock()
        self._write_mutex = threading.RLock()
        self.applied_seq = 0  # last log seq contained in the snapshot on disk
        self.generation = 0
        self.compact_every = 1000  # log entries past the snapshot before an automatic compaction
        self.metadata: dict[str, Any] = {}  # free-form, JSON-serialisable; kept in the manifest
        self._writer_lock = None  # open file holding DIR/writer.lock once this index writes
        self._cluster_map: IdLists | None = None  # row id -> list, built by clusters_of
        self.access_counts = AccessCounts(spec.nlist)  # decayed probes of the live stream
        self._tier: GpuTier | None = None
        self._tier_updater: TierUpdater | None = None
        self._bm25: BM25Index | None = None  # lexical side index (bm25.py), built on demand
        self._sectioned: bool | None = None  # `has_sections`, asked of the store on first use
        self._side = None  # the ensemble's second encoder (ensemble.py), built on first use
        self._side_synced = False

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        corpus: Iterable[Document],
        embedder: Embedder,
        *,
        progress: bool = False,
        passage_header: str = "path",
        **kwargs: Any,
    ) -> VectorIndex:
        """Embed `corpus` with `embedder` (passages read as `passage_text(doc,
        passage_header)`), then `from_vectors(..., **kwargs)` (nlist, kind, metric, nprobe...)."""
        docs = list(corpus)
        texts = [passage_text(d, passage_header) for d in docs]
        vectors = embedder.encode(texts, is_query=False, progress=progress)
        return cls.from_vectors(
            docs,
            vectors,
            embedder_name=embedder.name,
            embedder=embedder,
            passage_header=passage_header,
            **kwargs,
        )

    @classmethod
    def from_vectors(
        cls,
        docs: Sequence[Document],
        vectors: np.ndarray,
        *,
        embedder_name: str,
        nlist: int | None = None,
        kind: str = "ivf_flat",
        metric: str = "ip",
        nprobe: int | None = None,
        embedder: Embedder | None = None,
        passage_header: str = "path",
        **index_kwargs: Any,
    ) -> VectorIndex:
        """Build from precomputed vectors (`[len(docs), dim]`, embedded from
        `passage_text(doc, passage_header)`); `embedder_name` and the header are recorded."""
        check_header(passage_header)
        x = stepwise.check_vectors(vectors, len(docs))
        if len({d.id for d in docs}) != len(docs):
            raise ValueError("document ids must be unique")
        nlist = nlist or auto_nlist(len(docs))
        spec = IndexSpec(x.shape[1], nlist, kind, metric, embedder_name, nprobe or 1)
        index = stepwise.make_ivf(spec.dim, nlist, kind, metric, **index_kwargs)
        stepwise.train(index, x, max_train=256 * nlist)
        store = DocStore(None)
        store.set_meta("dim", str(spec.dim))
        row_ids, _ = store.upsert(docs, x)
        index.add_with_ids(x, np.asarray(row_ids, dtype=np.int64))
        vi = cls(index, store, spec, embedder=embedder)
        vi.metadata["passage_header"] = passage_header
        if nprobe is None:  # exhaustive when small, else measured (calibrate.py)
            from ragserve.retrieval.calibrate import calibrate_nprobe

            calibration = calibrate_nprobe(index, x, np.asarray(row_ids, dtype=np.int64))
            vi.spec = dataclasses.replace(spec, nprobe=calibration.nprobe)
            vi.metadata["nprobe_calibration"] = calibration.to_dict()
        return vi

    # -- step-wise search -----------------------------------------------------------------------

    def assign(self, queries: np.ndarray, nprobe: int | None = None) -> ProbePlan:
        """Each query's `nprobe` nearest clusters with their coarse distances, best first."""
        return stepwise.assign(self._index, queries, nprobe or self.spec.nprobe)

    def scan(
        self,
        queries: np.ndarray,
        cluster_ids_per_query: ProbePlan | np.ndarray,
        topk: int,
        state: TopK | None = None,
    ) -> TopK:
        """Scan the given clusters of each query and merge into `state` (a previous `TopK`).
        A `ProbePlan` slice is bit-exact for every kind; a bare int array `[n, w]` (`-1` pads)
        has its coarse distances recomputed (exact for IVF-Flat and L2 SQ8)."""
        plan = cluster_ids_per_query
        if not isinstance(plan, ProbePlan):
            plan = self._plan_for(queries, np.asarray(plan, dtype=np.int64))
        self.access_counts.observe(plan.cluster_ids)
        with self._rw.read():
            part = self._locked_scan(queries, plan, topk)
        updater = self._tier_updater
        if updater is not None:
            updater.note_scan()
        return stepwise.merge(state, part, self.spec.is_l2)

    def search(
        self,
        queries: np.ndarray,
        topk: int,
        nprobe: int | None = None,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's name (see filters.py)
    ) -> TopK:
        """One-shot search: `assign` then one `scan` of all probed clusters. With a metadata
        `filter` only matching documents are returned, `topk` of them when enough match."""
        if filter is not None:
            return self._filtered_search(queries, topk, nprobe, self.allowed_row_ids(filter))
        found = self._tier_search(queries, topk, nprobe)
        if found is not None:
            return found
        return self.scan(queries, self.assign(queries, nprobe), topk)

    def search_text(
        self,
        texts: Sequence[str],
        topk: int,
        *,
        nprobe: int | None = None,
        mode: str | None = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's name (see filters.py)
        collapse_sections: bool | None = None,
    ) -> list[list[ScoredDocument]]:
        """Search with query texts, best first, in `mode` (`modes.MODES`; None: `default_mode`),
        optionally `filter`ed on metadata and collapsed to one passage per section (None: the
        index's `collapse_sections`). Dense, unfiltered and uncollapsed, this is `search`."""
        mode = mode or self.default_mode
        collapse_sections = self.collapses(collapse_sections)
        if mode == "dense" and filter is None and not collapse_sections:
            result = self.search(self.embedder.encode(list(texts), is_query=True), topk, nprobe)
            return self.documents_of(result)
        return self._search_text_modes(
            texts, topk, nprobe=nprobe, mode=mode, flt=filter, collapse_sections=collapse_sections
        )

    def allowed_row_ids(self, filter: dict[str, Any]) -> np.ndarray:  # noqa: A002
        """Sorted row ids of the live documents whose metadata passes `filter`."""
        from ragserve.retrieval.filters import filter_sql, validate_filter

        flt = validate_filter(filter)
        where, args = filter_sql(flt) if flt else ("1", [])
        return self._store.row_ids_where(where, args)

    def vectors_of(self, row_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(live row ids, their stored float32 vectors) among `row_ids`, by row id."""
        return self._store.vectors([int(r) for r in row_ids])

    def documents_of(self, result: TopK) -> list[list[ScoredDocument]]:
        """Resolve a `TopK` into documents, dropping missing slots and deleted documents."""
        docs = iter(self._store.get([int(i) for i in result.ids.ravel()]))
        hits = [[(next(docs), float(s)) for s in scores] for scores in result.scores]
        return [[ScoredDocument(d, s) for d, s in row if d is not None] for row in hits]

    def _plan_for(self, queries: np.ndarray, cluster_ids: np.ndarray) -> ProbePlan:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        centroids = self._index.quantizer.reconstruct_n(0, self.spec.nlist)
        safe = np.where(cluster_ids < 0, 0, cluster_ids)
        c = centroids[safe]  # [n, w, dim]
        if self.spec.is_l2:
            dist = ((q[:, None, :] - c) ** 2).sum(-1)
        else:
            dist = np.einsum("nd,nwd->nw", q, c)
        return ProbePlan(cluster_ids, np.where(cluster_ids < 0, 0, dist).astype(np.float32))

    # -- documents (save / load / compact and the writer lock: persist.py) -----------------------

    def get_documents(self, ids: Iterable[int | str]) -> list[Document | None]:
        """Documents by Faiss row id (as in `TopK.ids`; `-1` → None) or by document id (str)."""
        return self._store.get(list(ids))

    def add_documents(self, docs: Sequence[Document], vectors: np.ndarray | None = None) -> None:
        """Insert or replace (by `id`) documents; durable on disk before this returns.
        `vectors` (`[len(docs), dim]`) skips embedding, for callers that embedded already."""
        docs = list(docs)
        if not docs:
            return
        x = self._upsert_vectors(docs, vectors, self.embed_text)
        side = self._side_upsert_vectors(docs)
        with self._write_mutex:
            self._claim_writer()
            added, removed = self._store.upsert(docs, x)
            if self._sectioned is False:
                from ragserve.retrieval.collapse import has_section

                self._sectioned = any(has_section(d) for d in docs)
            self._apply(docs, x, side, added, removed)

    def delete_documents(self, doc_ids: Iterable[str]) -> int:
        """Delete documents by id (unknown ids are ignored); durable before this returns.
        Returns how many were deleted."""
        with self._write_mutex:
            self._claim_writer()
            removed = self._store.delete(list(doc_ids))
            self._apply([], np.zeros((0, self.spec.dim), np.float32), None, [], removed)
        return len(removed)

    def _apply(self, docs: list[Document], x: np.ndarray, side, added: list, removed: list):
        """Mirror a committed store change (rows `added` = `docs` with vectors `x`, rows
        `removed`) into Faiss, the GPU tier, BM25 and the ensemble's side index; compact when
        due."""
        if added or removed:
            with self._rw.write():
                before = self._list_sizes() if self._tier is not None else None
                if removed:
                    self._index.remove_ids(np.asarray(removed, dtype=np.int64))
                if added:
                    self._index.add_with_ids(x, np.asarray(added, dtype=np.int64))
                self._cluster_map = None
                if before is not None:
                    _, dest = self._index.quantizer.search(x, 1)
                    changed = np.flatnonzero(self._list_sizes() != before)
                    self._invalidate_tier(np.concatenate([changed, dest.ravel()]))
            if self._bm25 is not None:
                from ragserve.retrieval.bm25 import passage_text

                texts = [passage_text(d) for d in docs]
                self._bm25.apply(list(zip(added, texts, strict=True)), removed, self._store)
            if self._side is not None and added and side is None:
                self._side_synced = False  # the next `side_dense()` embeds what is missing
            elif self._side is not None:
                self._side.apply(np.asarray(added, dtype=np.int64), side, removed)
        self._maybe_compact()

    # -- properties -----------------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        return int(self._index.ntotal)

    @property
    def faiss_index(self) -> faiss.IndexIVF:
        """The underlying Faiss index (read-only use; mutate only through this class)."""
        return self._index

    def cluster_sizes(self) -> np.ndarray:
        """int64 `[nlist]`: number of vectors in each inverted list."""
        with self._rw.read():
            return self._list_sizes()

    def _list_sizes(self) -> np.ndarray:
        invlists = self._index.invlists
        return np.array([invlists.list_size(c) for c in range(self.spec.nlist)], np.int64)

    def cluster_cost_bytes(self) -> np.ndarray:
        """int64 `[nlist]`: bytes a scan reads per cluster (list size × code size)."""
        return self.cluster_sizes() * int(self._index.code_size)

    def clusters_of(self, ids: np.ndarray) -> np.ndarray:
        """int64: the inverted list holding each Faiss row id (``-1`` for unknown ids); the map
        is built on first use after any write."""
        with self._rw.read():
            cmap = self._cluster_map
            if cmap is None:
                cmap = self._cluster_map = IdLists.of(self._index)
        return cmap(ids)

    def serialize(self) -> np.ndarray:
        """The Faiss index serialised (uint8), consistent with concurrent upserts."""
        with self._rw.read():
            return faiss.serialize_index(self._index)

    def check_integrity(self) -> None:
        """Assert the Faiss index holds exactly the document store's live rows."""
        with self._write_mutex:
            in_store, _ = self._store.vectors()
            held = {"Faiss": IdLists.of(self._index).ids}
            if self._bm25 is not None:
                held["BM25"] = self._bm25.row_ids()
            if self._side is not None and self._side_synced:
                held["ensemble"] = self._side.row_ids()
        for name, ids in held.items():
            assert np.array_equal(ids, in_store), (
                f"{name}/store mismatch: {len(ids)} in {name}, {len(in_store)} stored, "
                f"{len(np.setxor1d(ids, in_store))} differ"
            )

    def search_profile(self):
        """The `SearchProfile` measured for this index (`DIR/profile.json`), or None."""
        from ragserve.retrieval.latency_model import SearchProfile

        path = self.directory / "profile.json" if self.directory else None
        return SearchProfile.load(path) if path is not None and path.is_file() else None

    def info(self) -> dict[str, Any]:
        sizes = self.cluster_sizes()
        return {
            "directory": str(self.directory) if self.directory else None,
            **dataclasses.asdict(self.spec),  # dim, nlist, kind, metric, embedder, nprobe
            "nprobe_calibration": self.metadata.get("nprobe_calibration"),
            "default_mode": self.default_mode,
            "collapse_sections": self.collapse_sections,
            "has_bm25": self._bm25 is not None,
            "passage_header": self.passage_header,
            "ensemble": self.metadata.get("ensemble"),
            "finetune_encoder": self.metadata.get("finetune_encoder"),
            "num_documents": self.num_documents,
            "code_size_bytes": int(self._index.code_size),
            "cluster_size_min": int(sizes.min()),
            "cluster_size_max": int(sizes.max()),
            "generation": self.generation,
            "applied_seq": self.applied_seq,
            "pending_log_entries": self._store.last_seq() - self.applied_seq,
        }

    def close(self) -> None:
        self.drop_gpu_tier()
        self._store.close()
        self._release_writer()
