"""The arrays and passages of worker results as Arrow record batches (one row per result).

    generation:  prompt_token_ids list<int64> (null: not sent) | new_token_ids list<int64>
    retrieval:   passages list<struct<doc_id, text, title, score>>

The slim messages (``wire.py``) carry everything else; ``attach_*`` puts the columns back
into them. Reading uses the batch's buffers in place (a batch read from shared memory is never
copied before this); the Python values built here (``Passage``, token tuples) are what the
scheduler then uses.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from ragserve.graph import Passage
from ragserve.scheduler import GenerationUpdate

TOKENS = pa.list_(pa.int64())
GENERATION_SCHEMA = pa.schema([("prompt_token_ids", TOKENS), ("new_token_ids", TOKENS)])
PASSAGE = pa.struct(
    [
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("title", pa.string()),
        ("score", pa.float64()),
    ]
)
RETRIEVAL_SCHEMA = pa.schema([("passages", pa.list_(PASSAGE))])


def generation_batch(updates: list[GenerationUpdate]) -> pa.RecordBatch:
    """The token ids of ``updates``, one row each."""
    prompts = [u.prompt_token_ids for u in updates]
    return pa.record_batch(
        [
            pa.array(prompts, type=TOKENS),
            pa.array([u.new_token_ids for u in updates], type=TOKENS),
        ],
        schema=GENERATION_SCHEMA,
    )


def attach_generation(slim: tuple[GenerationUpdate, ...], batch: pa.RecordBatch) -> list:
    """``slim`` updates with their token ids from ``batch`` (``ValueError`` if it does not
    match them)."""
    _check(batch, GENERATION_SCHEMA, len(slim))
    prompts = _token_rows(batch.column(0))
    news = _token_rows(batch.column(1))
    return [
        replace(u, prompt_token_ids=p, new_token_ids=n or ())
        for u, p, n in zip(slim, prompts, news, strict=True)
    ]


def retrieval_batch(results: list[Any]) -> pa.RecordBatch:
    """The passages of ``results`` (anything with a ``passages`` tuple), one row each."""
    flat = [p for r in results for p in r.passages]
    offsets = np.zeros(len(results) + 1, dtype=np.int32)
    np.cumsum([len(r.passages) for r in results], out=offsets[1:])
    passages = pa.StructArray.from_arrays(
        [
            pa.array([p.doc_id for p in flat], type=pa.string()),
            pa.array([p.text for p in flat], type=pa.string()),
            pa.array([p.title for p in flat], type=pa.string()),
            pa.array([p.score for p in flat], type=pa.float64()),
        ],
        fields=list(PASSAGE),
    )
    column = pa.ListArray.from_arrays(pa.array(offsets), passages, type=pa.list_(PASSAGE))
    return pa.record_batch([column], schema=RETRIEVAL_SCHEMA)


def attach_retrieval(slim: tuple[Any, ...], batch: pa.RecordBatch) -> list:
    """``slim`` results with their passages from ``batch`` (``ValueError`` if it does not
    match them)."""
    _check(batch, RETRIEVAL_SCHEMA, len(slim))
    column = batch.column(0)
    offsets = column.offsets.to_numpy().tolist()
    values = column.values
    fields = [values.field(i).to_pylist() for i in range(4)]
    passages = [Passage(*row) for row in zip(*fields, strict=True)]
    return [
        replace(r, passages=tuple(passages[offsets[i] : offsets[i + 1]]))
        for i, r in enumerate(slim)
    ]


def _token_rows(column: pa.ListArray) -> list[tuple[int, ...] | None]:
    """Each row's ids as a tuple (``None`` for a null row), read from the buffers in place."""
    offsets = column.offsets.to_numpy()
    ids = column.values.to_numpy(zero_copy_only=True).tolist()
    valid = column.is_valid().to_pylist()
    return [
        tuple(ids[offsets[i] : offsets[i + 1]]) if valid[i] else None for i in range(len(column))
    ]


def _check(batch: pa.RecordBatch, schema: pa.Schema, num_rows: int) -> None:
    """``ValueError`` unless ``batch`` has ``schema``, ``num_rows`` and consistent buffers
    (``validate(full=True)``: offsets in range, valid UTF-8; a corrupt payload must fail
    here, not crash the reader)."""
    if not batch.schema.equals(schema):
        raise ValueError(f"the payload's schema is {batch.schema}, expected {schema}")
    if batch.num_rows != num_rows:
        raise ValueError(f"the payload has {batch.num_rows} rows for {num_rows} results")
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"the payload is corrupt: {exc}") from None
