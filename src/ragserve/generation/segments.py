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

from collections.abc import Sequence
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


def whitespace_newline_counts(tokenizer: Any) -> dict[int, int]:
    """``{token id: newlines}`` for the tokenizer's whitespace-only tokens (``{}`` for none).

    Decoding the vocabulary takes about a second: one result per tokenizer object and
    process (``engine_setup.load_tokenizer`` shares the object between engines).
    """
    if tokenizer is None:
        return {}
    hit = _CACHE.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        ids = list(range(len(tokenizer)))
        texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
        counts = tuple((i, t.count("\n")) for i, t in zip(ids, texts, strict=True) if t.isspace())
        hit = _CACHE[id(tokenizer)] = (tokenizer, counts)
    return dict(hit[1])


_CACHE: dict[int, tuple[Any, tuple[tuple[int, int], ...]]] = {}
