"""Prompts made of segments: instructions, passages (keyed, reusable KV), the question."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt; a prompt given as segments is their concatenation.

    ``content`` is text (tokenized on its own: only the first segment gets the tokenizer's
    special prefix, e.g. BOS) or token ids. A ``key`` names the passage: its KV may be stored
    once and reused wherever the segment lands (cache fusion); ``None`` is always computed.
    """

    content: str | list[int]
    key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.content, str | list):
            raise ValueError(f"Segment.content must be str or list[int], got {self.content!r}")
        if not self.content:
            raise ValueError("Segment.content is empty")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"Segment.key must be a non-empty string or None, got {self.key!r}")


def paragraph_segments(text: str) -> list[Segment]:
    """``text`` as segments split after blank lines (``"\\n\\n"``): the paragraphs between
    the first and the last (a rendered answer template's passages) keyed by a digest of their
    text, so the same passage anywhere in any prompt reuses its stored KV."""
    parts = [p + "\n\n" for p in text.split("\n\n")]
    parts[-1] = parts[-1][:-2]
    parts = [p for p in parts if p]
    if len(parts) < 3:
        return [Segment(text)]
    keyed = [Segment(p, key=hashlib.sha1(p.encode()).hexdigest()) for p in parts[1:-1]]
    return [Segment(parts[0]), *keyed, Segment(parts[-1])]


def tokenize_segments(
    segments: Sequence[Segment], tokenize: Callable[[str, bool], list[int]] | None
) -> tuple[list[int], list[tuple[int, int, str | None]]]:
    """``(token ids, [(start, end, key) per segment])``; ``tokenize(text, is_first)``.

    Raises ``ValueError`` for no segments, a text segment without a tokenizer, or a segment
    that tokenizes to nothing.
    """
    if not segments:
        raise ValueError("prompt: no segments")
    ids: list[int] = []
    spans: list[tuple[int, int, str | None]] = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, Segment):
            raise ValueError(f"prompt: segment {i} is a {type(seg).__name__}, not a Segment")
        if isinstance(seg.content, str):
            if tokenize is None:
                raise ValueError("this model has no tokenizer: give segments as token ids")
            toks = tokenize(seg.content, i == 0)
        else:
            toks = [int(t) for t in seg.content]
        if not toks:
            raise ValueError(f"prompt: segment {i} has no tokens")
        spans.append((len(ids), len(ids) + len(toks), seg.key))
        ids.extend(toks)
    return ids, spans
