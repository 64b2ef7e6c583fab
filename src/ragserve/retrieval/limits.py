"""What an upserted document may hold (``DocumentLimits``, ``check_document``); past a limit it
is rejected (``ValueError`` naming the field), never truncated: an ``id`` of 1..max characters
without ``/``, control characters or lone surrogates, not ``.``/``..`` (so
``DELETE /v1/documents/{id}`` can name it); a non-empty ``text`` (split long texts into
passages: one larger than a context fails every query retrieving it); an optional ``title``;
``metadata`` a JSON object within a depth and a size. Every string must encode as UTF-8.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DocumentLimits:
    max_id_chars: int = 256
    max_text_chars: int = 16_384
    max_title_chars: int = 1_024
    max_metadata_depth: int = 8
    max_metadata_bytes: int = 16_384

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = DocumentLimits()


def check_text(name: str, value: Any, max_chars: int) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ValueError(f"{name} has {len(value)} characters; the limit is {max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} holds an unpaired surrogate at position {exc.start} (not valid Unicode)"
        ) from None


def check_doc_id(doc_id: Any, limits: DocumentLimits = DEFAULT_LIMITS, name: str = "id") -> None:
    check_text(name, doc_id, limits.max_id_chars)
    if not doc_id or doc_id in (".", ".."):
        raise ValueError(f"{name} must be a non-empty name other than '.' and '..'")
    for pos, char in enumerate(doc_id):
        if char == "/" or unicodedata.category(char) in ("Cc", "Cs"):
            raise ValueError(
                f"{name} must not contain '/' or control characters (got {char!r} at {pos})"
            )


def check_metadata(
    metadata: Any, limits: DocumentLimits = DEFAULT_LIMITS, name: str = "metadata"
) -> None:
    """Iterative: any depth is rejected cleanly, never a RecursionError."""
    if not isinstance(metadata, dict):
        raise ValueError(f"{name} must be an object, got {type(metadata).__name__}")
    stack: list[tuple[Any, str, int]] = [(metadata, name, 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, (dict, list, tuple)) and depth > limits.max_metadata_depth:
            raise ValueError(f"{name} is nested deeper than {limits.max_metadata_depth} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}: keys must be strings, got {type(key).__name__}")
                check_text(f"{where} key", key, limits.max_metadata_bytes)
                stack.append((item, f"{where}.{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            check_text(where, value, limits.max_metadata_bytes)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {value}")
        elif value is not None and not isinstance(value, (bool, int, float)):
            raise ValueError(f"{where} must be a JSON value, got {type(value).__name__}")
    size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
    if size > limits.max_metadata_bytes:
        raise ValueError(
            f"{name} is {size} bytes as JSON; the limit is {limits.max_metadata_bytes}"
        )


def check_document(doc: Any, limits: DocumentLimits = DEFAULT_LIMITS, where: str = "") -> None:
    """A ``Document`` within ``limits``; ``where`` prefixes field names (``"documents[3]."``)."""
    check_doc_id(doc.id, limits, f"{where}id")
    check_text(f"{where}text", doc.text, limits.max_text_chars)
    if not doc.text.strip():
        raise ValueError(f"{where}text must not be empty")
    if doc.title is not None:
        check_text(f"{where}title", doc.title, limits.max_title_chars)
    check_metadata(doc.metadata if doc.metadata is not None else {}, limits, f"{where}metadata")
