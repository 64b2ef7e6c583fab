"""Search mode "ensemble": a second dense encoder beside the index's own, fused with it (and
BM25) over the pool of each ranker's top `depth` by per-query z-scored exact similarities,
`z_main + weight · z_side + bm25_weight · z_bm25` (docs/architecture.md, "Quality modes").
The side vectors mirror the store's live rows (synced on first use after a load) and are
snapshotted as `ensemble-<gen>/` beside each Faiss snapshot."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragserve.retrieval.stepwise import exact_topk
from ragserve.retrieval.storage import write_dir_atomically
from ragserve.retrieval.types import TopK

if TYPE_CHECKING:
    from ragserve.retrieval.embedder import Embedder

CONFIG_KEY = "ensemble"  # index metadata: the EnsembleConfig as a dict (set at build)
ROW_IDS, VECTORS = "row_ids.npy", "vectors.npy"


@dataclass(frozen=True)
class EnsembleConfig:
    """The side encoder and the fusion weights (the index's own weighs 1); defaults measured in
    BENCHMARKS.md, "Retrieval quality (issue 14)"."""

    embedder: str = "multilingual-e5-small-q4"
    weight: float = 1.0
    bm25_weight: float = 0.2
    depth: int = 50  # hits taken from each ranker into the pool

    def __post_init__(self) -> None:
        if not self.embedder:
            raise ValueError("ensemble embedder must be named")
        if self.weight < 0 or self.bm25_weight < 0:
            raise ValueError("ensemble weights must be >= 0")
        if self.depth < 1:
            raise ValueError(f"ensemble depth must be >= 1, got {self.depth}")


def zscore(scores: np.ndarray) -> np.ndarray:
    """(s - mean) / std over the last axis; all zeros where the scores do not vary."""
    s = np.asarray(scores, dtype=np.float64)
    std = s.std(axis=-1, keepdims=True)
    return np.where(std > 0, (s - s.mean(axis=-1, keepdims=True)) / np.where(std > 0, std, 1), 0)


def fuse(
    pool: np.ndarray, parts: list[tuple[float, np.ndarray]], topk: int
) -> tuple[np.ndarray, np.ndarray]:
    """One query's top `topk` (ids, fused scores) of `pool` by `parts` (weight, exact scores
    over the pool), ties in pool order."""
    fused = np.zeros(len(pool))
    for weight, scores in parts:
        if weight:
            fused += weight * zscore(scores)
    order = np.argsort(-fused, kind="stable")[:topk]
    return pool[order], fused[order].astype(np.float32)


class SideDense:
    """Unit vectors of the live passages under the side encoder, by row id, searched exhaustively.
    Writers replace the arrays whole under a lock; readers take the current pair."""

    def __init__(self, embedder_name: str, row_ids: np.ndarray, vectors: np.ndarray) -> None:
        self.embedder_name = embedder_name
        self._row_ids = np.asarray(row_ids, dtype=np.int64)
        self._vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self._embedder: Embedder | None = None
        self._lock = threading.Lock()

    @property
    def embedder(self) -> Embedder:
        with self._lock:
            if self._embedder is None:
                from ragserve.retrieval.embedder import load_embedder

                self._embedder = load_embedder(self.embedder_name)
            return self._embedder

    def set_embedder(self, embedder: Embedder) -> None:
        with self._lock:
            self._embedder = embedder

    def row_ids(self) -> np.ndarray:
        with self._lock:
            return np.sort(self._row_ids)

    def apply(self, added: np.ndarray, vectors: np.ndarray, removed) -> None:
        """Mirror a committed upsert/delete: `added` row ids with their side `vectors`."""
        added = np.asarray(added, dtype=np.int64)
        with self._lock:
            keep = ~np.isin(self._row_ids, np.asarray(list(removed), dtype=np.int64))
            rows, x = self._row_ids[keep], self._vectors[keep]
            if len(added):
                new = np.asarray(vectors, dtype=np.float32).reshape(len(added), -1)
                x = new if not len(x) else np.concatenate([x, new])
                rows = np.concatenate([rows, added])
            self._row_ids, self._vectors = rows, np.ascontiguousarray(x)

    def search(self, queries: np.ndarray, topk: int, allowed: np.ndarray | None = None) -> TopK:
        """Top-`topk` row ids per query by inner product (`-1` pads), among `allowed`."""
        with self._lock:
            rows, x = self._row_ids, self._vectors
        if allowed is not None:
            mask = np.isin(rows, allowed)
            rows, x = rows[mask], x[mask]
        return exact_topk(queries, rows, x, topk)

    def scores_of(self, query: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """Inner products of one query with the passages `row_ids` (each must be present)."""
        with self._lock:
            rows, x = self._row_ids, self._vectors
        order = np.argsort(rows)
        pos = order[np.searchsorted(rows, row_ids, sorter=order)]
        return x[pos] @ np.asarray(query, dtype=np.float32)

    def save(self, directory: Path, name: str) -> None:
        """Write `directory/name/` atomically."""
        with self._lock:
            rows, x = self._row_ids, self._vectors

        def fill(folder: Path) -> None:
            np.save(folder / ROW_IDS, rows)
            np.save(folder / VECTORS, x)

        write_dir_atomically(directory, name, fill)

    @classmethod
    def load(cls, path: Path, embedder_name: str) -> SideDense:
        """Read a snapshot; raises `ValueError` naming the folder if it is unreadable."""
        try:
            rows, x = np.load(path / ROW_IDS), np.load(path / VECTORS)
        except (OSError, ValueError) as exc:
            raise ValueError(f"unreadable ensemble snapshot {path}: {exc}") from None
        if x.ndim != 2 or len(x) != len(rows):
            raise ValueError(f"unreadable ensemble snapshot {path}: {len(rows)} ids, {x.shape}")
        return cls(embedder_name, rows, x)


class EnsembleMixin:
    """`VectorIndex`'s side index, built at `enable_ensemble` or on first use, kept in sync by
    the index's write path."""

    _side: SideDense | None
    _side_synced: bool

    @property
    def ensemble_config(self) -> EnsembleConfig | None:
        data = self.metadata.get(CONFIG_KEY)
        return EnsembleConfig(**data) if data else None

    def enable_ensemble(
        self, config: EnsembleConfig | None = None, *, embedder: Embedder | None = None
    ) -> int:
        """Record `config` in the index and embed every passage with its encoder (`embedder`: an
        instance instead of loading it); returns how many were embedded. Saved with the index."""
        config = config or EnsembleConfig()
        with self._write_mutex:
            current = self.ensemble_config
            if current is not None and current.embedder != config.embedder:
                raise ValueError(
                    f"index already has ensemble embedder {current.embedder!r}; "
                    "rebuild to change it"
                )
            self.metadata[CONFIG_KEY] = asdict(config)
        return self._sync_side(embedder)

    def side_dense(self, embedder: Embedder | None = None) -> SideDense:
        """The side index, synced with the store (embeds what it lacks on first use)."""
        if self.ensemble_config is None:
            raise ValueError(
                "mode 'ensemble' needs an index built with an ensemble "
                "(`index build --ensemble`, `VectorIndex.enable_ensemble`)"
            )
        if self._side is None or not self._side_synced or embedder is not None:
            self._sync_side(embedder)
        return self._side

    def _sync_side(self, embedder: Embedder | None) -> int:
        with self._write_mutex:
            name = self.ensemble_config.embedder
            if self._side is None:
                self._side = SideDense(name, np.zeros(0, np.int64), np.zeros((0, 0), np.float32))
            if embedder is not None:
                self._side.set_embedder(embedder)
            if self._side_synced:
                return 0
            # drop the rows no longer live, embed the live ones the side index lacks
            live, have = self._store.row_ids_where("1"), self._side.row_ids()
            missing = np.setdiff1d(live, have)
            texts = [self.embed_text(d) for d in self._store.get(missing.tolist())]
            vectors = self._side.embedder.encode(texts, is_query=False) if len(missing) else None
            self._side.apply(missing, vectors, np.setdiff1d(have, live))
            self._side_synced = True
            return len(missing)

    def _side_upsert_vectors(self, docs) -> np.ndarray | None:
        """Side vectors of `docs` about to be upserted (None: no synced side index)."""
        if self._side is None or not self._side_synced:
            return None
        return self._side.embedder.encode([self.embed_text(d) for d in docs], is_query=False)
