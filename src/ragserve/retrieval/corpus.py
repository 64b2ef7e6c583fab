"""Corpus ingest: JSONL, a folder of .txt/.md/.rst files, or Parquet → `Document`s, and
chunking into overlapping word or token windows.

JSONL / Parquet records need `text`; `id` (else `<file>:<line>`), `title` and `metadata` (an
object) are optional, and any other field goes into `metadata`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ragserve.retrieval.types import Document

TEXT_SUFFIXES = (".txt", ".md", ".rst")


def load_corpus(path: str | Path) -> Iterator[Document]:
    """Documents from a `.jsonl` file, a `.parquet` file, or a folder of text files."""
    path = Path(path)
    if path.is_dir():
        yield from _folder(path)
    elif path.suffix in (".jsonl", ".ndjson") or path.name.endswith(".jsonl.txt"):
        yield from _jsonl(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    elif not path.exists():
        raise FileNotFoundError(f"no corpus at {path}")
    else:
        raise ValueError(f"unsupported corpus {path}: expected .jsonl, .parquet or a folder")


def chunk_documents(
    docs: Iterable[Document],
    *,
    size: int = 200,
    overlap: int = 40,
    unit: str = "word",
    tokenizer: Any = None,
) -> Iterator[Document]:
    """Split each document into windows of `size` words (or `tokenizer` tokens) overlapping by
    `overlap`, cut from the original text. A document that fits one window keeps its id; else
    chunk `i` gets id `<id>#<i>` and metadata `source_id`/`chunk`."""
    if size < 1 or not 0 <= overlap < size:
        raise ValueError(f"need size >= 1 and 0 <= overlap < size, got {size}, {overlap}")
    if unit not in ("word", "token"):
        raise ValueError(f"unit must be 'word' or 'token', got {unit!r}")
    if unit == "token" and tokenizer is None:
        raise ValueError("unit='token' needs a tokenizer")
    for doc in docs:
        spans = _word_spans(doc.text) if unit == "word" else _token_spans(doc.text, tokenizer)
        windows = _windows(len(spans), size, overlap)
        if len(windows) <= 1:
            yield doc
            continue
        for i, (a, b) in enumerate(windows):
            text = doc.text[spans[a][0] : spans[b - 1][1]]
            meta = {**doc.metadata, "source_id": doc.id, "chunk": i}
            yield Document(f"{doc.id}#{i}", text, doc.title, meta)


def _windows(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) windows over n units; the last window ends at n."""
    out, start, step = [], 0, size - overlap
    while True:
        out.append((start, min(start + size, n)))
        if start + size >= n:
            return out
        start += step


def _word_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def _token_spans(text: str, tokenizer: Any) -> list[tuple[int, int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [tuple(span) for span in enc["offset_mapping"] if span[1] > span[0]]


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


def _folder(root: Path) -> Iterator[Document]:
    for path in sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            rel = path.relative_to(root).as_posix()
            yield Document(rel, text, _title_of(text, path), {"path": rel})


def _title_of(text: str, path: Path) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            return line.lstrip("#").strip() or path.stem
        if line:
            break
    return path.stem
