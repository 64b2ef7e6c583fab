"""The previous default passages, a baseline for ``retrieval_corpora.py``: a folder's raw
``.txt``/``.md``/``.rst`` files (``raw_folder``) cut into overlapping word or token windows
(``chunk_documents``). ``ragserve index build`` ingests folders per format instead."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ragserve.retrieval.types import Document

TEXT_SUFFIXES = (".txt", ".md", ".rst")


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


def raw_folder(root: Path) -> Iterator[Document]:
    """Each text file below `root` as one document, id and `path` its relative path."""
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
