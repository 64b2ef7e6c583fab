"""Splitting a saved `VectorIndex` into shard folders that search exactly like it
(docs/scale_out.md)::

    ROOT/layout.json        num_shards, partition, owners (cluster -> shard), source
    ROOT/quantizer.faiss    the coarse quantizer every shard shares (assignment happens once)
    ROOT/shard-<i>/         a complete `VectorIndex` folder

Shards keep the source's quantizer, codebooks and row ids; new rows of shard ``i`` get ids
from ``(i + 1) << ROW_ID_SHIFT`` on.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ragserve.retrieval.index import VectorIndex
from ragserve.retrieval.persist import write_snapshot
from ragserve.retrieval.storage import DOCSTORE, atomic_write_bytes, publish_dir, scratch_dir

PARTITIONS = ("list", "document")
ROW_ID_SHIFT = 40
LAYOUT = "layout.json"
QUANTIZER = "quantizer.faiss"


@dataclass(frozen=True)
class ShardLayout:
    """Where each cluster (``"list"``: ``owners``) or document (``"document"``) lives."""

    num_shards: int
    partition: str = "list"
    owners: tuple[int, ...] | None = None  # cluster -> shard; ``"list"`` only

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if (self.partition == "list") != (self.owners is not None):
            raise ValueError("owners must be given for partition='list' and only for it")

    def owner_of_document(self, doc_id: str) -> int:
        """A stable hash of the id."""
        digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.num_shards

    def owners_of_clusters(self, cluster_ids: np.ndarray) -> np.ndarray:
        """Shard of each cluster id (``-1`` pads stay ``-1``)."""
        owners = np.asarray(self.owners, dtype=np.int64)
        return np.where(cluster_ids < 0, -1, owners[np.where(cluster_ids < 0, 0, cluster_ids)])

    def shard_dir(self, root: Path, shard: int) -> Path:
        return root / f"shard-{shard}"


def balance_lists(costs: np.ndarray, num_shards: int) -> tuple[int, ...]:
    """Owner of each list: largest first onto the cheapest shard (LPT; ties: lower shard)."""
    load = np.zeros(num_shards, dtype=np.float64)
    owners = np.zeros(len(costs), dtype=np.int64)
    for c in np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable"):
        s = int(np.argmin(load))
        owners[c] = s
        load[s] += float(costs[c])
    return tuple(int(o) for o in owners)


def read_layout(root: str | Path) -> ShardLayout:
    data = json.loads((Path(root) / LAYOUT).read_text())
    owners = data.get("owners")
    return ShardLayout(int(data["num_shards"]), data["partition"], owners and tuple(owners))


def split_index(source: Path, root: Path, num_shards: int, partition: str = "list") -> ShardLayout:
    """Write ``root`` (new) with ``num_shards`` shard folders of the index at ``source``."""
    source, root = Path(source).absolute(), Path(root).absolute()
    if root.exists():
        raise FileExistsError(f"{root} exists; remove it or use its layout")
    vi = VectorIndex.load(source)
    try:
        row_ids, _ = vi._store.vectors()
        if len(row_ids) and int(row_ids.max()) >= 1 << ROW_ID_SHIFT:
            raise ValueError(f"{source} has row ids past 2**{ROW_ID_SHIFT}; cannot shard it")
        owners = balance_lists(vi.cluster_cost_bytes(), num_shards) if partition == "list" else None
        layout = ShardLayout(num_shards, partition, owners)
        owner_of_row = _row_owners(vi, layout, row_ids)
        tmp = scratch_dir(root)
        for shard in range(num_shards):
            keep = row_ids[owner_of_row == shard]
            _write_shard(vi, layout.shard_dir(tmp, shard), shard, keep, row_ids)
        faiss.write_index(vi.faiss_index.quantizer, str(tmp / QUANTIZER))
        meta = {"num_shards": num_shards, "partition": partition, "source": str(source)}
        meta["owners"] = None if owners is None else list(owners)
        atomic_write_bytes(tmp / LAYOUT, json.dumps(meta).encode())
        publish_dir(tmp, root)
    finally:
        vi.close()
    return layout


def _row_owners(vi: VectorIndex, layout: ShardLayout, row_ids: np.ndarray) -> np.ndarray:
    if layout.partition == "document":
        docs = vi.get_documents([int(r) for r in row_ids])
        return np.array([layout.owner_of_document(d.id) for d in docs], dtype=np.int64)
    return layout.owners_of_clusters(vi.clusters_of(row_ids))


def _write_shard(
    vi: VectorIndex, directory: Path, shard: int, keep: np.ndarray, all_rows: np.ndarray
) -> None:
    directory.mkdir()
    drop = np.setdiff1d(all_rows, keep)
    index = faiss.clone_index(vi.faiss_index)
    if len(drop):
        index.remove_ids(drop.astype(np.int64))
    seq = vi._store.last_seq()
    vi._store.copy_to(directory / DOCSTORE)
    conn = sqlite3.connect(str(directory / DOCSTORE), isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TEMP TABLE keep (row_id INTEGER PRIMARY KEY)")
        conn.executemany("INSERT INTO keep VALUES (?)", ((int(r),) for r in keep))
        conn.execute("DELETE FROM docs WHERE row_id NOT IN (SELECT row_id FROM keep)")
        conn.execute("DELETE FROM ops")
        conn.execute("DELETE FROM sqlite_sequence WHERE name IN ('docs', 'ops')")
        base = (shard + 1) << ROW_ID_SHIFT
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('docs', ?)", (base,))
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('ops', ?)", (seq,))
        conn.execute("COMMIT")
        conn.execute("VACUUM")
    finally:
        conn.close()
    data = faiss.serialize_index(index)
    write_snapshot(directory, vi.spec, index, data, 1, seq, {**vi.metadata, "shard": shard})
