"""`VectorIndex.search_text`'s modes (docs/architecture.md, "Search modes"): dense, BM25,
hybrid (reciprocal rank fusion) and ensemble (`ensemble.py`), each optionally filtered on
metadata (`filters.py`) and collapsed to one passage per section (`collapse.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import faiss
import numpy as np

from ragserve.retrieval.collapse import FETCH_FACTOR, collapse_hits
from ragserve.retrieval.stepwise import exact_topk
from ragserve.retrieval.types import ScoredDocument, TopK

if TYPE_CHECKING:
    from ragserve.retrieval.filters import Filter

MODES = ("dense", "bm25", "hybrid", "ensemble")
RRF_K = 60  # the constant of Cormack et al. (2009): fused score = sum 1 / (RRF_K + rank)
HYBRID_DEPTH = 50  # hits taken from each ranking before fusion
EXHAUSTIVE_FILTER_MAX = 65536  # matching passages scored by brute force up to this many


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def rrf_fuse(rankings: Sequence[np.ndarray], topk: int, k: int = RRF_K) -> list[tuple[int, float]]:
    """Reciprocal rank fusion of id rankings (best first, `-1` ignored): `(id, score)` best
    first, score = sum over rankings of 1 / (k + rank), rank from 1; ties by first appearance."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc_id in enumerate(int(i) for i in ranking if i >= 0):
            fused[doc_id] = fused.get(doc_id, 0.0) + 1.0 / (k + rank + 1)
    order = sorted(fused.items(), key=lambda item: -item[1])  # stable: first seen wins ties
    return order[:topk]


def _no_hits(n: int, topk: int) -> TopK:
    return TopK(np.full((n, topk), -1, dtype=np.int64), np.zeros((n, topk), dtype=np.float32))


class SearchModesMixin:
    """`VectorIndex.search_text`'s modes, filters and collapsing (module doc)."""

    def _filtered_search(
        self, queries: np.ndarray, topk: int, nprobe: int | None, allowed: np.ndarray
    ) -> TopK:
        """Dense top-`topk` among the row ids `allowed` (sorted int64): brute force over a
        small set, else a Faiss id selector with `nprobe` doubled until `topk` hits."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if len(allowed) <= EXHAUSTIVE_FILTER_MAX:
            return exact_topk(q, *self.vectors_of(allowed), topk, self.spec.is_l2)
        selector = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
        probe = nprobe or self.spec.nprobe
        while True:
            params = faiss.SearchParametersIVF(sel=selector, nprobe=probe)  # keeps no reference
            with self._rw.read():
                scores, ids = self._index.search(q, topk, params=params)
            if probe >= self.nlist or (ids >= 0).all():
                return TopK(ids, scores)
            probe = min(self.nlist, probe * 2)

    def _search_text_modes(
        self,
        texts: Sequence[str],
        topk: int,
        *,
        nprobe: int | None,
        mode: str,
        flt: Filter | None,
        collapse_sections: bool = False,
    ) -> list[list[ScoredDocument]]:
        """`search_text` for every mode and filter (scores: dense → Faiss's, bm25 → BM25's,
        hybrid → the fused RRF score). Collapsing searches a query whose top `topk` hold a
        section twice again `FETCH_FACTOR` times deeper, until it has `topk` sections or its
        ranking ran out."""
        check_mode(mode)
        allowed = self.allowed_row_ids(flt) if flt is not None else None
        texts = list(texts)
        vectors = None if mode == "bm25" else self.embedder.encode(texts, is_query=True)
        # NOTE: the ensemble's queries are embedded once here, not again per deeper collapse pass
        side_embedder = self.side_dense().embedder if mode == "ensemble" else None
        side = None if side_embedder is None else side_embedder.encode(texts, is_query=True)
        if not collapse_sections:
            return self._ranked(texts, vectors, topk, nprobe, mode, allowed, side)
        out: list[list[ScoredDocument]] = [[] for _ in texts]
        limit = max(topk, self.num_documents)
        todo, depth = list(range(len(texts))), topk
        while todo:
            part = None if vectors is None else vectors[todo]
            part_side = None if side is None else side[todo]
            ranked = self._ranked(
                [texts[i] for i in todo], part, depth, nprobe, mode, allowed, part_side
            )
            deeper = []
            for i, hits in zip(todo, ranked, strict=True):
                out[i] = collapse_hits(hits, topk)
                if len(out[i]) < topk and len(hits) == depth and depth < limit:
                    deeper.append(i)
            todo, depth = deeper, min(limit, depth * FETCH_FACTOR)
        return out

    def _ranked(
        self,
        texts: list[str],
        vectors: np.ndarray | None,
        topk: int,
        nprobe: int | None,
        mode: str,
        allowed: np.ndarray | None,
        side_vectors: np.ndarray | None = None,
    ) -> list[list[ScoredDocument]]:
        """Uncollapsed top `topk` per query (`vectors`: `texts` embedded, None for bm25;
        `side_vectors`: under the ensemble's side encoder)."""
        if mode == "bm25":
            return self.documents_of(self.bm25().search(texts, topk, allowed))
        if mode == "ensemble":
            found = self._ensemble(texts, vectors, side_vectors, topk, nprobe, allowed)
            return self.documents_of(found)
        depth = topk if mode == "dense" else max(topk, HYBRID_DEPTH)
        dense = self._dense(vectors, depth, nprobe, allowed)
        if mode == "dense":
            return self.documents_of(dense)
        lexical = self.bm25().search(texts, depth, allowed)
        out = _no_hits(len(texts), topk)
        for q, (d, b) in enumerate(zip(dense.ids, lexical.ids, strict=True)):
            hits = rrf_fuse([d, b], topk)
            out.ids[q, : len(hits)] = [i for i, _ in hits]
            out.scores[q, : len(hits)] = [s for _, s in hits]
        return self.documents_of(out)

    def _dense(self, vectors, topk: int, nprobe: int | None, allowed: np.ndarray | None) -> TopK:
        if allowed is None:
            return self.search(vectors, topk, nprobe)
        return self._filtered_search(vectors, topk, nprobe, allowed)

    def _ensemble(
        self,
        texts: list[str],
        vectors: np.ndarray,
        side_queries: np.ndarray,
        topk: int,
        nprobe: int | None,
        allowed: np.ndarray | None,
    ) -> TopK:
        """The pool of each ranker's top `depth`, every member scored exactly by each ranker,
        z-scored per ranker and summed with the configured weights (`ensemble.py`)."""
        from ragserve.retrieval.ensemble import fuse

        config = self.ensemble_config
        side = self.side_dense()
        depth = max(topk, config.depth)
        rankings = [self._dense(vectors, depth, nprobe, allowed).ids]
        rankings.append(side.search(side_queries, depth, allowed).ids)
        if config.bm25_weight:
            rankings.append(self.bm25().search(texts, depth, allowed).ids)
        out = _no_hits(len(texts), topk)
        for q in range(len(texts)):
            seen = np.concatenate([r[q] for r in rankings])
            pool = seen[np.sort(np.unique(seen, return_index=True)[1])]  # first-seen order
            pool = pool[pool >= 0]
            if not len(pool):
                continue
            live, x = self.vectors_of(pool)
            pool = pool[np.isin(pool, live)]  # a row deleted since its ranker saw it
            x = x[np.searchsorted(live, pool)]
            if self.spec.is_l2:
                main = -((x - vectors[q]) ** 2).sum(axis=1)
            else:
                main = x @ vectors[q]
            parts = [(1.0, main), (config.weight, side.scores_of(side_queries[q], pool))]
            if config.bm25_weight:
                parts.append((config.bm25_weight, self.bm25().scores_of(texts[q], pool)))
            top, fused = fuse(pool, parts, topk)
            out.ids[q, : len(top)], out.scores[q, : len(top)] = top, fused
        return out
