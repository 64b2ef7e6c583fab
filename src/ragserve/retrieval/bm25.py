"""BM25 over the live passages (bm25s, English Snowball stemming), kept beside the Faiss index:
it mirrors the store's live rows (`apply`, after the store committed), is rebuilt lazily after
writes, saved as `DIR/bm25-<gen>/` with each Faiss snapshot, and replays the log on load."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragserve.retrieval.storage import write_dir_atomically
from ragserve.retrieval.types import TopK

ROW_IDS = "row_ids.npy"


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    """Lower-cased word tokens, English stop words dropped, Snowball-stemmed."""
    import bm25s
    import Stemmer

    return bm25s.tokenize(
        list(texts),
        stopwords="en",
        stemmer=Stemmer.Stemmer("english"),
        return_ids=False,
        show_progress=False,
    )


class BM25Index:
    """Lexical scores of queries against the live passages, by Faiss row id; thread-safe, a
    search sees every earlier `apply`. `_tokens` (row id → tokens) is filled from the store on
    the first write after a load, so a read-only index never re-tokenizes its corpus."""

    def __init__(self, row_ids: np.ndarray, retriever, tokens: dict[int, list[str]] | None):
        self._row_ids = np.asarray(row_ids, dtype=np.int64)
        self._retriever = retriever
        self._tokens = tokens
        self._dirty = False
        self._lock = threading.Lock()

    @classmethod
    def from_texts(cls, row_ids: Sequence[int], texts: Sequence[str]) -> BM25Index:
        index = cls(np.zeros(0, np.int64), None, _tokenized(zip(row_ids, texts, strict=True)))
        index._dirty = True
        return index

    def row_ids(self) -> np.ndarray:
        """Sorted int64 row ids of the passages this index scores."""
        with self._lock:
            if self._tokens is not None:
                return np.array(sorted(self._tokens), dtype=np.int64)
            return self._row_ids.copy()

    def apply(self, added: Sequence[tuple[int, str]], removed: Sequence[int], store) -> None:
        """Mirror a committed upsert/delete: `added` (row id, passage text), `removed` row ids."""
        with self._lock:
            if self._tokens is None:
                self._tokens = _tokenized(live_texts(store, self._row_ids))
            for row_id in removed:
                self._tokens.pop(int(row_id), None)
            self._tokens.update(_tokenized(added))
            self._dirty = True

    def search(self, texts: Sequence[str], topk: int, allowed: np.ndarray | None = None) -> TopK:
        """Top-`topk` row ids per query by BM25 score (best first; `-1` pads: fewer passages
        share a term with the query). `allowed`: sorted row ids a hit must be one of."""
        queries = tokenize(texts)
        ids = np.full((len(queries), topk), -1, dtype=np.int64)
        scores = np.zeros((len(queries), topk), dtype=np.float32)
        row_ids, retriever = self._current()
        if retriever is None:
            return TopK(ids, scores)
        mask = None if allowed is None else np.isin(row_ids, allowed)
        for q, terms in enumerate(queries):
            if not terms:
                continue
            s = np.asarray(retriever.get_scores(terms), dtype=np.float32)
            if mask is not None:
                s = np.where(mask, s, 0.0)
            hits = np.flatnonzero(s > 0)
            best = hits[np.argsort(-s[hits], kind="stable")[:topk]]
            ids[q, : len(best)] = row_ids[best]
            scores[q, : len(best)] = s[best]
        return TopK(ids, scores)

    def scores_of(self, text: str, row_ids: np.ndarray) -> np.ndarray:
        """BM25 scores of one query for the passages `row_ids` (0 for a row not indexed)."""
        out = np.zeros(len(row_ids), dtype=np.float32)
        terms = tokenize([text])[0]
        rows, retriever = self._current()
        if retriever is None or not terms:
            return out
        s = np.asarray(retriever.get_scores(terms), dtype=np.float32)
        pos = np.searchsorted(rows, row_ids).clip(max=len(rows) - 1)  # `rows` are sorted
        found = rows[pos] == row_ids
        out[found] = s[pos[found]]
        return out

    def _current(self):
        """(row ids, retriever), the retriever rebuilt after writes (None: no passages)."""
        with self._lock:
            self._refresh()
            return self._row_ids, self._retriever

    def _refresh(self) -> None:
        if not self._dirty:
            return
        import bm25s

        rows = sorted(self._tokens)
        self._row_ids = np.array(rows, dtype=np.int64)
        self._retriever = None
        if rows:
            self._retriever = bm25s.BM25()
            self._retriever.index([self._tokens[r] for r in rows], show_progress=False)
        self._dirty = False

    # -- files ----------------------------------------------------------------------------------

    def save(self, directory: Path, name: str) -> None:
        with self._lock:
            self._refresh()
            write_dir_atomically(directory, name, self._write)

    def _write(self, folder: Path) -> None:
        np.save(folder / ROW_IDS, self._row_ids)
        if self._retriever is not None:
            self._retriever.save(str(folder), show_progress=False)

    @classmethod
    def load(cls, path: Path) -> BM25Index:
        """Read a saved snapshot; raises `ValueError` naming the file if it is unreadable."""
        import bm25s

        try:
            row_ids = np.load(path / ROW_IDS)
            retriever = None
            if len(row_ids):
                retriever = bm25s.BM25.load(str(path), show_progress=False)
                if retriever.scores["num_docs"] != len(row_ids):
                    raise ValueError(f"{len(row_ids)} row ids for {retriever.scores['num_docs']}")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable BM25 snapshot {path}: {exc}") from None
        return cls(row_ids, retriever, None)


def _tokenized(pairs) -> dict[int, list[str]]:
    """Row id -> tokens of (row id, text) pairs."""
    pairs = list(pairs)
    texts = tokenize([text for _, text in pairs]) if pairs else []
    return dict(zip((int(r) for r, _ in pairs), texts, strict=True))


def live_texts(store, row_ids) -> list[tuple[int, str]]:
    """(row id, `passage_text`) of the passages among `row_ids` still in `store`."""
    docs = store.get([int(r) for r in row_ids])
    return [(int(r), passage_text(d)) for r, d in zip(row_ids, docs, strict=True) if d is not None]


def passage_text(doc) -> str:
    """What BM25 indexes of a passage: its heading path and its text."""
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


def load_snapshot(path: Path, store, applied_seq: int) -> BM25Index:
    """The snapshot at `path` with the store's log past `applied_seq` replayed into it (inside
    the Faiss replay's store read snapshot); `ValueError` if unreadable."""
    index = BM25Index.load(path)
    ops = store.ops_after(applied_seq)
    if ops:
        added = sorted({r for _, op, r in ops if op == "add"})
        index.apply(live_texts(store, added), sorted({r for _, _, r in ops}), store)
    return index
