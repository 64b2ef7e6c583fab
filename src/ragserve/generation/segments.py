"""A prompt's segments: caller ``Segment``s (keyed passages for cache fusion), their token
spans and ``FusionPlan``, and the document ends the knowledge tree finds in plain token ids."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Span = tuple[int, int, str | None]  # (start, end, key) of one segment's tokens


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt (text, tokenized alone, or token ids); a ``key`` names a passage
    whose KV cache fusion may store once and reuse anywhere (``None``: always computed)."""

    content: str | list[int]
    key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.content, str | list):
            raise ValueError(f"Segment.content must be str or list[int], got {self.content!r}")
        if not self.content:
            raise ValueError("Segment.content is empty")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"Segment.key must be a non-empty string or None, got {self.key!r}")


def num_picked(num_tokens: int, ratio: float) -> int:
    """Tokens recomputed of a keyed segment of ``num_tokens``: ``ceil(ratio * n)``."""
    return min(num_tokens, math.ceil(ratio * num_tokens - 1e-9))


@dataclass(frozen=True)
class FusionPlan:
    """A request's segments as ``(start, end, key)`` token spans and its recompute ratio."""

    spans: tuple[Span, ...]
    ratio: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be in [0, 1], got {self.ratio}")

    @property
    def num_keyed_tokens(self) -> int:
        return sum(e - s for s, e, key in self.spans if key is not None)

    def max_rows(self, num_tokens: int) -> int:
        """Most rows a fused prefill of ``num_tokens`` computes (its token-budget cost)."""
        picked = sum(num_picked(e - s, self.ratio) for s, e, key in self.spans if key is not None)
        return min(num_tokens, num_tokens - self.num_keyed_tokens + picked + 1)


def paragraph_segments(text: str) -> list[Segment]:
    """``text`` as segments split after blank lines (``"\\n\\n"``): the paragraphs between
    the first and the last keyed by a digest of their text."""
    parts = [p + "\n\n" for p in text.split("\n\n")]
    parts[-1] = parts[-1][:-2]
    parts = [p for p in parts if p]
    if len(parts) < 3:
        return [Segment(text)]
    keyed = [Segment(p, key=hashlib.sha1(p.encode()).hexdigest()) for p in parts[1:-1]]
    return [Segment(parts[0]), *keyed, Segment(parts[-1])]


def tokenize_segments(
    segments: Sequence[Segment], tokenize: Callable[[str, bool], list[int]] | None
) -> tuple[list[int], list[Span]]:
    """``(token ids, [(start, end, key) per segment])``; ``tokenize(text, is_first)``;
    ``ValueError`` for no segments or an empty one, or text without a tokenizer."""
    if not segments:
        raise ValueError("prompt: no segments")
    ids: list[int] = []
    spans: list[Span] = []
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


def find_segment_ends(token_ids: Sequence[int], newline_counts: dict[int, int]) -> list[int]:
    """Exclusive ends of the documents of ``token_ids`` (the last is ``len``): a document ends
    after whitespace-only tokens (``newline_counts``: id -> newlines) with a blank line."""
    ends: list[int] = []
    run = 0
    for i, tok in enumerate(token_ids):
        n = newline_counts.get(tok)
        if n is None:
            if run >= 2:
                ends.append(i)
            run = 0
        else:
            run += n
    if not ends or ends[-1] != len(token_ids):
        ends.append(len(token_ids))
    return ends


def whitespace_newline_counts(tokenizer: Any) -> dict[int, int]:
    """``{token id: newlines}`` for the tokenizer's whitespace-only tokens (``{}`` for none);
    NOTE: decoding the vocabulary takes ~1 s: one result per tokenizer object."""
    return {} if tokenizer is None else dict(_newline_counts(tokenizer))


@functools.cache  # tokenizers hash by identity
def _newline_counts(tokenizer: Any) -> tuple[tuple[int, int], ...]:
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return tuple((i, t.count("\n")) for i, t in zip(ids, texts, strict=True) if t.isspace())
