"""Persistent document store (SQLite, WAL, synchronous=FULL): passages, their vectors, and the
operation log that makes upserts durable before they are acknowledged.

```
docs(row_id PK AUTOINCREMENT, doc_id UNIQUE, title, text, metadata JSON, vector BLOB)  live rows
ops(seq PK AUTOINCREMENT, op 'add'|'del', row_id)                                      the log
meta(key PK, value)                                                                    dim, ...
```

`row_id` is a passage's Faiss id, never reused (AUTOINCREMENT). A write is on disk (fsync'd
WAL) when `upsert`/`delete` return.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ragserve.retrieval.types import Document

SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    row_id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL UNIQUE, title TEXT,
    text TEXT NOT NULL, metadata TEXT NOT NULL, vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS ops (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, row_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class DocStore:
    """Documents by Faiss row id and by string doc id; thread-safe. `path=None`: in memory."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.RLock()
        name = ":memory:" if path is None else str(path)
        self._conn = sqlite3.connect(name, check_same_thread=False, isolation_level=None)
        if path is not None:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- writes (each one transaction, durable on return) ------------------------------------

    def upsert(self, docs: Sequence[Document], vectors: np.ndarray) -> tuple[list[int], list[int]]:
        """Insert or replace `docs` by `doc_id`; returns (new row ids, replaced row ids)."""
        added, removed = [], []
        with self._lock, self._txn():
            for doc, vec in zip(docs, np.asarray(vectors, dtype=np.float32), strict=False):
                removed += self._delete_row(doc.id)
                cur = self._conn.execute(
                    "INSERT INTO docs (doc_id, title, text, metadata, vector) VALUES (?,?,?,?,?)",
                    (doc.id, doc.title, doc.text, json.dumps(doc.metadata), vec.tobytes()),
                )
                self._conn.execute(
                    "INSERT INTO ops (op, row_id) VALUES ('add', ?)", (cur.lastrowid,)
                )
                added.append(int(cur.lastrowid))
        return added, removed

    def delete(self, doc_ids: Iterable[str]) -> list[int]:
        """Delete documents by `doc_id` (unknown ids are ignored); returns the removed row ids."""
        with self._lock, self._txn():
            return [row for doc_id in doc_ids for row in self._delete_row(doc_id)]

    def _delete_row(self, doc_id: str) -> list[int]:
        """Inside a transaction: delete (and log) `doc_id`'s row; its row id, if any."""
        row = self._conn.execute("SELECT row_id FROM docs WHERE doc_id = ?", (doc_id,)).fetchone()
        if row is None:
            return []
        self._conn.execute("DELETE FROM docs WHERE row_id = ?", row)
        self._conn.execute("INSERT INTO ops (op, row_id) VALUES ('del', ?)", row)
        return [row[0]]

    def truncate_log(self, upto_seq: int) -> None:
        """Drop log entries already covered by a durable index snapshot."""
        with self._lock, self._txn():
            self._conn.execute("DELETE FROM ops WHERE seq <= ?", (upto_seq,))

    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self._txn():
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # -- reads ---------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self._query("SELECT value FROM meta WHERE key = ?", (key,))
        return row[0][0] if row else None

    def last_seq(self) -> int:
        row = self._query("SELECT MAX(seq) FROM ops")
        seq = row[0][0]
        if seq is None:  # the log may have been truncated: AUTOINCREMENT remembers the high mark
            high = self._query("SELECT seq FROM sqlite_sequence WHERE name = 'ops'")
            return int(high[0][0]) if high else 0
        return int(seq)

    def ops_after(self, seq: int) -> list[tuple[int, str, int]]:
        rows = self._query("SELECT seq, op, row_id FROM ops WHERE seq > ? ORDER BY seq", (seq,))
        return [tuple(r) for r in rows]

    def count(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM docs")[0][0])

    def vectors(self, row_ids: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(row ids int64 `[m]`, vectors float32 `[m, dim]`) of live rows (all, or those given)."""
        if row_ids is None:
            rows = self._query("SELECT row_id, vector FROM docs ORDER BY row_id")
        else:
            rows = self._query_in("SELECT row_id, vector FROM docs WHERE row_id", list(row_ids))
            rows.sort(key=lambda r: r[0])
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        if not rows:
            return ids, np.zeros((0, int(self.get_meta("dim") or 0)), dtype=np.float32)
        return ids, np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])

    def get(self, keys: Sequence[int | str]) -> list[Document | None]:
        """Documents by Faiss row id (int; negative → None) or by doc id (str), in order."""
        by_row = self._fetch(
            "row_id", sorted({int(k) for k in keys if not isinstance(k, str) and int(k) >= 0})
        )
        by_doc = self._fetch("doc_id", sorted({k for k in keys if isinstance(k, str)}))
        return [by_doc.get(k) if isinstance(k, str) else by_row.get(int(k)) for k in keys]

    def _fetch(self, column: str, keys: list) -> dict:
        sql = f"SELECT {column}, doc_id, title, text, metadata FROM docs WHERE {column}"
        rows = self._query_in(sql, keys)
        return {key: Document(i, text, title, json.loads(m)) for key, i, title, text, m in rows}

    def row_ids_where(self, where: str, args: Sequence = ()) -> np.ndarray:
        """Sorted int64 row ids of live documents matching an SQL `where` over `docs`
        (`filters.filter_sql` builds it from a metadata filter)."""
        rows = self._query(f"SELECT row_id FROM docs WHERE {where} ORDER BY row_id", args)
        return np.array([r[0] for r in rows], dtype=np.int64)

    def any_where(self, where: str, args: Sequence = ()) -> bool:
        """Whether any live document matches an SQL `where` over `docs`."""
        return bool(self._query(f"SELECT 1 FROM docs WHERE {where} LIMIT 1", args))

    def check(self) -> None:
        """Raise `sqlite3.DatabaseError` if the file fails SQLite's own consistency check."""
        result = self._query("PRAGMA quick_check")
        if not result or result[0][0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {result[:3]}")

    # -- files ---------------------------------------------------------------------------------

    def copy_to(self, path: Path) -> None:
        """Write a consistent copy of the whole store into a new SQLite file at `path`."""
        with self._lock:
            dest = sqlite3.connect(str(path))
            self._conn.backup(dest)
            dest.execute("PRAGMA journal_mode=WAL")
            dest.close()

    @contextmanager
    def read_snapshot(self) -> Iterator[None]:
        """Reads inside see one committed state, even while another process writes."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield
            finally:
                self._conn.execute("COMMIT")

    def _query(self, sql: str, args: Sequence = ()) -> list:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    def _query_in(self, sql: str, keys: list) -> list:
        """`sql` + ` IN (keys)`, 500 keys a query (SQLite's limit on arguments)."""
        chunks = (keys[i : i + 500] for i in range(0, len(keys), 500))
        return [
            row for c in chunks for row in self._query(f"{sql} IN ({','.join('?' * len(c))})", c)
        ]

    @contextmanager
    def _txn(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
