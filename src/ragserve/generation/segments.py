"""Where a prompt's documents begin and end, for the knowledge tree.

The design: a prompt's segments are found in its token ids, so every caller (the RAG
workflows, the HTTP front, plain ``generate``) gets document nodes without a new message
field. A segment ends after a run of whitespace-only tokens that holds at least two
newlines (a blank line): the built-in answer templates put the instructions, each passage
and the question in their own paragraphs. Boundaries only group blocks into nodes (the
unit of PGDSF's frequency and cost); reuse itself is exact at block level, so a missed or
extra boundary never changes an output.

``Sequence.segment_ends`` set by a caller (explicit segments, e.g. the ``Segment`` prompts
cache fusion will add) takes precedence over the detected ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


def find_segment_ends(token_ids: Sequence[int], newline_counts: dict[int, int]) -> list[int]:
    """Exclusive end positions of the segments of ``token_ids``; the last is ``len``.

    ``newline_counts`` maps each whitespace-only token id to the newlines it holds; any other
    token ends a whitespace run.
    """
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


def whitespace_newline_counts(tokenizer: Any, cache_key: Hashable = None) -> dict[int, int]:
    """``{token id: newlines}`` for the tokenizer's whitespace-only tokens (``{}`` for none).

    Decoding the vocabulary takes about a second; tokenizers with the same ``cache_key`` (a
    digest of their files) share one result per process.
    """
    if tokenizer is None:
        return {}
    key = cache_key if cache_key is not None else id(tokenizer)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = _counts(tokenizer)
    return dict(hit)


_CACHE: dict[Hashable, tuple[tuple[int, int], ...]] = {}


def _counts(tokenizer: Any) -> tuple[tuple[int, int], ...]:
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return tuple((i, t.count("\n")) for i, t in zip(ids, texts, strict=True) if t and t.isspace())
