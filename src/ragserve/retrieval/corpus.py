"""Corpus records: JSONL or Parquet → `Document`s. A record needs `text`; `id` (else
`<file>:<line>`), `title` and `metadata` (an object) are optional, any other field goes into
`metadata`. (A folder is ingested per format: `ingest/`.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ragserve.retrieval.types import Document


def load_corpus(path: str | Path) -> Iterator[Document]:
    """Documents from a `.jsonl` or `.parquet` file."""
    path = Path(path)
    if path.suffix in (".jsonl", ".ndjson") or path.name.endswith(".jsonl.txt"):
        yield from _jsonl(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    elif not path.exists():
        raise FileNotFoundError(f"no corpus at {path}")
    else:
        raise ValueError(f"unsupported corpus {path}: expected .jsonl, .parquet or a folder")


def _record(rec: Any, default_id: str, where: str) -> Document:
    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
        raise ValueError(f"{where}: a record needs a string field 'text'")
    meta = dict(rec.get("metadata") or {})
    meta.update({k: v for k, v in rec.items() if k not in ("id", "text", "title", "metadata")})
    doc_id, title = rec.get("id"), rec.get("title")
    doc_id = str(doc_id) if doc_id is not None else default_id
    return Document(doc_id, rec["text"], str(title) if title is not None else None, meta)


def _jsonl(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            yield _record(rec, f"{path.stem}:{lineno}", where)


def _parquet(path: Path) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: Parquet corpora need pyarrow (pip install 'ragserve[parquet]')"
        ) from None
    table = pq.read_table(path)
    if "text" not in table.column_names:
        raise ValueError(f"{path}: Parquet corpus needs a 'text' column")
    for i, rec in enumerate(table.to_pylist()):
        yield _record(rec, f"{path.stem}:{i}", f"{path} row {i}")
