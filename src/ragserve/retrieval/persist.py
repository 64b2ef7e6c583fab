"""`PersistMixin`: `VectorIndex`'s `save` / `load` / `compact` of an index folder (layout in
`storage.py`). A load verifies the snapshot's checksum and replays the store's op log past its
`applied_seq`; the replay is idempotent (remove, then re-add live rows), so a crash between any
two steps of an upsert or a compaction recovers to the acknowledged state.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import shutil
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import faiss
import numpy as np

import ragserve.retrieval.bm25 as bm25
import ragserve.retrieval.finetune as finetune
from ragserve.retrieval.docstore import DocStore
from ragserve.retrieval.ensemble import SideDense
from ragserve.retrieval.storage import (
    DOCSTORE,
    FORMAT,
    FORMAT_VERSION,
    IndexCorruptError,
    atomic_write_bytes,
    publish_dir,
    read_manifest,
    remove_stale_files,
    scratch_dir,
    snapshot_lock,
    snapshot_name,
    verify_snapshot,
    write_manifest,
)
from ragserve.retrieval.types import IndexSpec

if TYPE_CHECKING:
    from ragserve.retrieval.embedder import Embedder

logger = logging.getLogger(__name__)

_Index = TypeVar("_Index", bound="PersistMixin")
_LOAD_ATTEMPTS = 20  # each retry needs a compaction to have finished since the last one
# side indexes snapshotted with each generation: VectorIndex attribute -> (metadata key, prefix)
_SIDECARS = {"_bm25": ("bm25_snapshot", "bm25-"), "_side": ("ensemble_snapshot", "ensemble-")}


class PersistMixin:
    """`VectorIndex`'s side on disk; needs its `_store`, `_write_mutex`, `_writer_lock`,
    `directory`, `generation`, `applied_seq`, `compact_every`, `metadata`, `spec`, `serialize`."""

    def save(self, directory: str | Path) -> Path:
        """Write the index to `directory` (new or empty; or its own directory = compaction),
        atomically, then attach the index to it."""
        directory = Path(directory).absolute()
        if self.directory is not None and directory == self.directory:
            self.compact()
            return directory
        tmp = scratch_dir(directory)
        with self._write_mutex:
            data, seq = self.serialize(), self._store.last_seq()
            try:
                self._store.copy_to(tmp / DOCSTORE)
                copy = DocStore(tmp / DOCSTORE)
                copy.truncate_log(seq)
                copy.close()
                _write_generation(self, tmp, data, 1, seq)
                publish_dir(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # NOTE: a failed save leaves no folder
                raise
            old, self._store = self._store, DocStore(directory / DOCSTORE)
            old.close()
            self._release_writer()  # the old folder is no longer written by this index
            self.directory, self.generation, self.applied_seq = directory, 1, seq
        logger.info("saved index (%d vectors) to %s", self.num_documents, directory)
        return directory

    @classmethod
    def load(
        cls: type[_Index], directory: str | Path, *, embedder: Embedder | None = None
    ) -> _Index:
        """Open a saved index, replaying upserts logged after its snapshot.

        Raises `IndexCorruptError` (a `ValueError`) naming the file that is truncated or
        corrupt. A concurrent compaction by the writing process (new manifest, old snapshot and
        log entries dropped) is detected by re-reading the manifest, and the load is retried.
        """
        directory = Path(directory).absolute()
        for attempt in range(_LOAD_ATTEMPTS):
            manifest = read_manifest(directory)
            try:
                with snapshot_lock(directory, exclusive=False):
                    return _load_once(cls, directory, read_manifest(directory), embedder)
            except IndexCorruptError:
                if attempt + 1 == _LOAD_ATTEMPTS or read_manifest(directory) == manifest:
                    raise
                logger.info("index %s changed while loading; retrying", directory)
                time.sleep(0.005 * (attempt + 1))
        raise AssertionError("unreachable")

    def compact(self) -> None:
        """Write a fresh snapshot covering the whole log, then drop the covered log entries."""
        if self.directory is None:
            raise ValueError("the index has no directory yet: call save(dir) first")
        with self._write_mutex:  # NOTE: upserts wait during a compaction; searches do not.
            self._claim_writer()
            data, seq, generation = self.serialize(), self._store.last_seq(), self.generation + 1
            with snapshot_lock(self.directory, exclusive=True):  # loads see before or after
                manifest = _write_generation(self, self.directory, data, generation, seq)
                remove_stale_files(self.directory, manifest, _SIDECARS.values())
                self._store.truncate_log(seq)
            self.generation, self.applied_seq = generation, seq
        logger.info("compacted %s to generation %d (log seq %d)", self.directory, generation, seq)

    def _maybe_compact(self) -> None:
        pending = self._store.last_seq() - self.applied_seq
        if self.directory is not None and pending >= self.compact_every:
            self.compact()

    def _claim_writer(self) -> None:
        """Hold `DIR/writer.lock` (flock) from the first write on: one writer per folder."""
        if self.directory is None or self._writer_lock is not None:
            return
        f = open(self.directory / "writer.lock", "w")  # noqa: SIM115 - held for the lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise RuntimeError(
                f"{self.directory} is being written by another process; one writer per index"
            ) from None
        self._writer_lock = f

    def _release_writer(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.close()
            self._writer_lock = None


def _write_generation(vi, directory: Path, data: np.ndarray, generation: int, seq: int) -> dict:
    """The side snapshots, then the Faiss snapshot `data` and the manifest naming them all."""
    for attr, (key, prefix) in _SIDECARS.items():
        part, name = getattr(vi, attr), f"{prefix}{generation:06d}"
        if part is None:
            vi.metadata.pop(key, None)
        else:
            part.save(directory, name)
            vi.metadata[key] = name
    return write_snapshot(directory, vi.spec, vi._index, data, generation, seq, vi.metadata)


def _load_once(cls, directory: Path, manifest: dict[str, Any], embedder: Embedder | None):
    snap = verify_snapshot(directory, manifest)
    try:
        index = faiss.read_index(str(snap))
    except RuntimeError as exc:
        raise IndexCorruptError(snap, f"Faiss cannot read it ({exc})") from None
    if not isinstance(index, faiss.IndexIVF) or index.d != manifest["dim"]:
        raise IndexCorruptError(snap, f"not an IVF index of dim {manifest['dim']}")
    store_path = directory / DOCSTORE
    if not store_path.is_file():
        raise IndexCorruptError(store_path, "file missing")
    metadata, seq = dict(manifest.get("metadata") or {}), manifest["applied_seq"]
    store = None
    try:
        store = DocStore(store_path)
        store.check()
        with store.read_snapshot():
            _replay(index, store, seq)
            count = store.count()
            load = partial(bm25.load_snapshot, store=store, applied_seq=seq)
            lexical = _load_sidecar(directory, metadata, "_bm25", load)
        if count != index.ntotal:
            reason = f"holds {count} documents but the index has {index.ntotal} vectors"
            raise IndexCorruptError(store_path, reason)
    except BaseException as exc:
        if store is not None:
            store.close()
        if isinstance(exc, sqlite3.DatabaseError):
            raise IndexCorruptError(store_path, f"SQLite error: {exc}") from None
        raise
    encoder = finetune.saved_encoder(directory, metadata) or manifest["embedder"]
    shape = (manifest[key] for key in ("dim", "nlist", "kind", "metric"))
    spec = IndexSpec(*shape, encoder, manifest.get("nprobe", 1))
    vi = cls(index, store, spec, embedder=embedder, directory=directory)
    vi.generation = int(manifest.get("generation", 1))
    vi.applied_seq = int(seq)
    vi.metadata = metadata
    vi._bm25 = lexical
    try:  # the side index is synced with the store on first use
        if (config := vi.ensemble_config) is not None:
            load = partial(SideDense.load, embedder_name=config.embedder)
            vi._side = _load_sidecar(directory, metadata, "_side", load)
        if metadata.get("query_adapter"):  # NOTE: a silently different ranking otherwise
            reason = "the query adapter was removed after e82677a: rebuild the index without it"
            raise IndexCorruptError(directory / "query_adapter.npy", reason)
    except IndexCorruptError:
        vi.close()
        raise
    return vi


def _load_sidecar(directory: Path, metadata: dict[str, Any], attr: str, load) -> Any:
    """`load(path)` of the side snapshot the manifest names for `attr` (None: none); its
    `ValueError` becomes an `IndexCorruptError` naming the folder."""
    name = metadata.get(_SIDECARS[attr][0])
    if not name:
        return None
    try:
        return load(directory / name)
    except ValueError as exc:
        raise IndexCorruptError(directory / name, str(exc)) from None


def write_snapshot(
    directory: Path,
    spec: IndexSpec,
    index: faiss.IndexIVF,
    data: np.ndarray,
    generation: int,
    applied_seq: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """Write `data` (`index` serialised) as generation `generation`'s snapshot, then the
    manifest naming it; returns the manifest."""
    name = snapshot_name(generation)
    atomic_write_bytes(directory / name, memoryview(data))
    manifest = build_manifest(
        spec,
        index,
        snapshot=name,
        sha256=hashlib.sha256(memoryview(data)).hexdigest(),
        num_bytes=int(data.nbytes),
        applied_seq=applied_seq,
        generation=generation,
        metadata=metadata,
    )
    write_manifest(directory, manifest)
    return manifest


def build_manifest(
    spec: IndexSpec,
    index: faiss.IndexIVF,
    *,
    snapshot: str,
    sha256: str,
    num_bytes: int,
    applied_seq: int,
    generation: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of a snapshot file `snapshot` of `index` (written by the caller)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ragserve_version = version("ragserve")
    except PackageNotFoundError:
        ragserve_version = "unknown"
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **dataclasses.asdict(spec),  # dim, nlist, kind, metric, embedder, nprobe
        "num_vectors": int(index.ntotal),
        "code_size_bytes": int(index.code_size),
        "snapshot": snapshot,
        "snapshot_sha256": sha256,
        "snapshot_bytes": int(num_bytes),
        "applied_seq": int(applied_seq),
        "generation": generation,
        "written_at": time.time(),
        "metadata": metadata,
        "versions": {
            "ragserve": ragserve_version,
            "faiss": faiss.__version__,
            "numpy": np.__version__,
        },
    }


def _replay(index: faiss.IndexIVF, store: DocStore, applied_seq: int) -> None:
    ops = store.ops_after(applied_seq)
    if not ops:
        return
    touched = sorted({row_id for _, _, row_id in ops})
    index.remove_ids(np.asarray(touched, dtype=np.int64))
    live_ids, vectors = store.vectors([r for _, op, r in ops if op == "add"])
    if len(live_ids):
        index.add_with_ids(vectors, live_ids)
    logger.info("replayed %d logged upserts past the snapshot", len(ops))
