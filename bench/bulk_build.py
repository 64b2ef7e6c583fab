"""Bulk build of a NEW persisted index directory from precomputed vectors, without the copies
`VectorIndex.from_vectors(...).save(dir)` makes (in-memory SQLite + backup, serialized index).

```
vectors [n, d] ─┬─ thread: DocStore.bulk_load ─────────────────────────> docs.sqlite
  (host, f32)   └─ train (Faiss or torch k-means on a 256·nlist sample)
                   assign (Faiss, or torch on the GPU) ─> add_preassigned ─> write_index
                   (streamed to index-000001.faiss.tmp, sha256 on the fly) ─> rename
                                                       both done ─> manifest.json ─> rename DIR
```

The result is `VectorIndex.save`'s format (docs/architecture.md, "Large builds"): generation 1,
`applied_seq = n`, row ids 1..n; with
`backend="faiss"` the index equals `VectorIndex.from_vectors` on the same data bit for bit, with
`backend="torch"` the assignment may differ from Faiss's only on float-rounding ties.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import faiss
import numpy as np

import gpu_kmeans
import ragserve.retrieval.stepwise as stepwise
from ragserve.retrieval.calibrate import calibrate_nprobe
from ragserve.retrieval.docstore import SCHEMA
from ragserve.retrieval.index import IndexSpec, auto_nlist
from ragserve.retrieval.persist import build_manifest
from ragserve.retrieval.storage import (
    DOCSTORE,
    fsync_dir,
    publish_dir,
    scratch_dir,
    snapshot_name,
    write_manifest,
)
from ragserve.retrieval.types import Document

logger = logging.getLogger(__name__)

ADD_CHUNK_ROWS = 1 << 18  # bounds Faiss's per-call scratch (PQ residuals) to ~chunk·d floats


class BulkBuildResult(NamedTuple):
    directory: Path
    seconds: dict[str, float]  # per phase; "docstore" overlaps the index phases


def build_index_directory(
    directory: str | Path,
    docs: Sequence[Document],
    vectors: np.ndarray,
    *,
    embedder_name: str,
    nlist: int | None = None,
    kind: str = "ivf_flat",
    metric: str = "ip",
    nprobe: int | None = None,
    device: str = "cpu",
    backend: str | None = None,
    seed: int = 0,
    centroids: np.ndarray | None = None,
    metadata: dict[str, Any] | None = None,
    **index_kwargs: Any,
) -> BulkBuildResult:
    """Write `docs` and `vectors` (float32 `[len(docs), d]`, C-contiguous: never copied) as a
    new index in `directory` (absent or empty), atomically: a crash leaves no `directory`.

    `backend` trains and assigns with "faiss" (CPU) or "torch" (on `device`); default: faiss on
    "cpu", torch otherwise. `centroids` (`[nlist, d]`) skip training. `nlist`, `nprobe` and
    `**index_kwargs` (pq_m, pq_nbits) mean what they mean in `VectorIndex.from_vectors`.
    """
    x = stepwise.check_vectors(vectors, len(docs))
    backend = backend or ("faiss" if device == "cpu" else "torch")
    if backend not in ("faiss", "torch") or (backend == "faiss" and device != "cpu"):
        raise ValueError(f"backend {backend!r} cannot run on device {device!r}")
    nlist = nlist or auto_nlist(len(x))
    spec = IndexSpec(x.shape[1], nlist, kind, metric, embedder_name, nprobe or 1)
    metadata = dict(metadata or {})
    directory = Path(directory).absolute()
    tmp = scratch_dir(directory)
    seconds: dict[str, float] = {}
    try:
        with ThreadPoolExecutor(1) as pool:
            store_job = pool.submit(_write_store, tmp / DOCSTORE, docs, x, seconds)
            index = _build_faiss(x, spec, device, backend, seed, centroids, seconds, index_kwargs)
            name = snapshot_name(1)
            t0 = time.perf_counter()
            sha256, num_bytes = _write_faiss(index, tmp / name)
            seconds["write_index"] = time.perf_counter() - t0
            applied_seq = store_job.result()
        if nprobe is None:  # as VectorIndex.from_vectors: exhaustive when small, else measured
            calibration = calibrate_nprobe(index, x)
            spec = dataclasses.replace(spec, nprobe=calibration.nprobe)
            metadata["nprobe_calibration"] = calibration.to_dict()
        manifest = build_manifest(
            spec,
            index,
            snapshot=name,
            sha256=sha256,
            num_bytes=num_bytes,
            applied_seq=applied_seq,
            generation=1,
            metadata=metadata,
        )
        write_manifest(tmp, manifest)
        publish_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "bulk-built %s: %d vectors, %s",
        directory,
        len(x),
        ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()),
    )
    return BulkBuildResult(directory, seconds)


def _write_store(path: Path, docs: Sequence[Document], x: np.ndarray, seconds: dict) -> int:
    t0 = time.perf_counter()
    n = write_store(path, docs, x)
    seconds["docstore"] = time.perf_counter() - t0
    return n


# NOTE: a float32 row of dim 768 (~3.1 KB) fills one 4 KiB page with ~1 KB to spare; 16 KiB
# pages hold five, so a bulk-built store is ~20% smaller (and faster to write and to check).
PAGE_SIZE = 16384


def write_store(path: Path, docs: Sequence[Document], x: np.ndarray) -> int:
    """Fill a new, empty `DocStore` file in one transaction; returns n = `len(docs)`.

    Rows get ids 1..n in order and nothing is logged: the `ops` sequence is advanced to n,
    the state `upsert` of the same rows followed by `truncate_log(n)` leaves, so a snapshot
    with `applied_seq = n` covers them. Written without a journal (a crash leaves a broken
    file: build it in a scratch folder), fsync'd, then set to WAL. Duplicate `doc_id`s raise
    `ValueError`.
    """
    conn = sqlite3.connect(str(path), isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new file only
        conn.executescript(SCHEMA)
        used = "SELECT EXISTS (SELECT 1 FROM docs) OR EXISTS (SELECT 1 FROM sqlite_sequence)"
        if conn.execute(used).fetchone()[0]:
            raise ValueError("write_store needs an empty store")
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-1048576")  # 1 GiB for the doc_id index
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('dim', ?)", (str(x.shape[1]),))
            conn.executemany(
                "INSERT INTO docs (row_id, doc_id, title, text, metadata, vector) "
                "VALUES (?,?,?,?,?,?)",
                _rows(docs, x),
            )
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('ops', ?)", (len(x),))
        except sqlite3.IntegrityError as exc:
            conn.execute("ROLLBACK")
            raise ValueError(f"document ids must be unique ({exc})") from None
        conn.execute("COMMIT")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()
    fsync_dir(path)
    return len(x)


def _rows(docs: Sequence[Document], x: np.ndarray) -> Iterator[tuple]:
    for row_id, (doc, vec) in enumerate(zip(docs, x, strict=True), start=1):
        meta = json.dumps(doc.metadata) if doc.metadata else "{}"
        yield row_id, doc.id, doc.title, doc.text, meta, vec  # vec: buffer, stored as a BLOB


def _build_faiss(
    x: np.ndarray,
    spec: IndexSpec,
    device: str,
    backend: str,
    seed: int,
    centroids: np.ndarray | None,
    seconds: dict,
    index_kwargs: dict,
) -> faiss.IndexIVF:
    t0 = time.perf_counter()
    index = stepwise.make_ivf(spec.dim, spec.nlist, spec.kind, spec.metric, **index_kwargs)
    max_train = 256 * spec.nlist
    if centroids is None and backend == "faiss":
        stepwise.train(index, x, max_train=max_train, seed=seed)  # as `from_vectors` does
    else:
        sample = stepwise.train_sample(x, max_train, seed)
        if centroids is None:
            centroids = gpu_kmeans.kmeans(sample, spec.nlist, spec.metric, device=device, seed=seed)
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.shape != (spec.nlist, spec.dim):
            raise ValueError(f"centroids must have shape ({spec.nlist}, {spec.dim}), got {c.shape}")
        index.quantizer.add(c)
        index.train(sample)  # the quantizer is full: trains only SQ/PQ codebooks
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    labels = _assign(index, x, spec.metric, device, backend)
    seconds["assign"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in range(0, len(x), ADD_CHUNK_ROWS):
        b = min(a + ADD_CHUNK_ROWS, len(x))
        ids = np.arange(a + 1, b + 1, dtype=np.int64)  # DocStore.bulk_load's row ids
        index.add_core(
            b - a, faiss.swig_ptr(x[a:b]), faiss.swig_ptr(ids), faiss.swig_ptr(labels[a:b])
        )
    seconds["add"] = time.perf_counter() - t0
    return index


def _assign(index: faiss.IndexIVF, x: np.ndarray, metric: str, device: str, backend: str):
    if backend == "torch":
        centroids = index.quantizer.reconstruct_n(0, index.nlist)
        return gpu_kmeans.assign(x, centroids, metric, device=device)
    labels = np.empty(len(x), dtype=np.int64)
    for a in range(0, len(x), ADD_CHUNK_ROWS):
        labels[a : a + ADD_CHUNK_ROWS] = index.quantizer.assign(x[a : a + ADD_CHUNK_ROWS], 1)[:, 0]
    return labels


def _write_faiss(index: faiss.IndexIVF, path: Path) -> tuple[str, int]:
    """Stream `index` into `path` (tmp → fsync → rename → fsync dir); returns (sha256, bytes)."""
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    num_bytes = 0
    with open(tmp, "wb") as f:

        def write(chunk: bytes) -> None:
            nonlocal num_bytes
            f.write(chunk)
            digest.update(chunk)
            num_bytes += len(chunk)

        faiss.write_index(index, faiss.PyCallbackIOWriter(write))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest.hexdigest(), num_bytes
