"""Worker results as Arrow record batches (one row per update / result): every
``GenerationUpdate`` field as a column; a retrieval result's passages as
``list<struct<doc_id, text, title, score>>`` (the slim results ride in the message and
``attach_retrieval`` puts the passages back). Reading uses the batch's buffers in place."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any

import numpy as np
import pyarrow as pa

from ragserve.graph import Passage
from ragserve.scheduler import GenerationUpdate

TOKENS = pa.list_(pa.int64())
GENERATION_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("text_delta", pa.string()),
        ("new_token_ids", TOKENS),
        ("finished", pa.bool_()),
        ("finish_reason", pa.string()),
        ("prompt_token_ids", TOKENS),
        ("final_text", pa.string()),
        ("error", pa.string()),
        ("error_kind", pa.string()),
    ]
)
_TOKEN_FIELDS = frozenset({"new_token_ids", "prompt_token_ids"})
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
    """``updates``, one row each."""
    columns = []
    for field in GENERATION_SCHEMA:
        values = [getattr(u, field.name) for u in updates]
        if field.name in _TOKEN_FIELDS:
            columns.append(_tokens_column(values))
        else:
            columns.append(pa.array(values, type=field.type))
    return pa.record_batch(columns, schema=GENERATION_SCHEMA)


def _tokens_column(rows: list[tuple[int, ...] | None]) -> pa.ListArray:
    """``rows`` as a list<int64> column (``None`` rows null), built from flat arrays."""
    offsets = list(itertools.accumulate((len(r) if r else 0 for r in rows), initial=0))
    values = np.fromiter(
        itertools.chain.from_iterable(r for r in rows if r), dtype=np.int64, count=offsets[-1]
    )
    mask = None
    if any(r is None for r in rows):
        mask = pa.array([r is None for r in rows], type=pa.bool_())
    offsets_array = pa.array(offsets, type=pa.int32())
    return pa.ListArray.from_arrays(offsets_array, pa.array(values), type=TOKENS, mask=mask)


def read_generation(task_ids: tuple[str, ...], batch: pa.RecordBatch) -> list:
    """The ``GenerationUpdate``s of ``batch`` (``ValueError`` unless they are those of
    ``task_ids``, in order)."""
    _check(batch, GENERATION_SCHEMA, len(task_ids))
    columns = [
        _token_rows(column) if field.name in _TOKEN_FIELDS else column.to_pylist()
        for field, column in zip(GENERATION_SCHEMA, batch.columns, strict=True)
    ]
    if columns[0] != list(task_ids):
        raise ValueError("the payload's task ids are not the message's")
    columns[2] = [ids or () for ids in columns[2]]
    return [GenerationUpdate(*row) for row in zip(*columns, strict=True)]


def retrieval_batch(results: list[Any]) -> pa.RecordBatch:
    """The passages of ``results``, one row each (empty for a result without a ``passages``
    tuple, such as an operator's)."""
    rows = [getattr(r, "passages", ()) for r in results]
    flat = [p for row in rows for p in row]
    offsets = list(itertools.accumulate((len(row) for row in rows), initial=0))
    passages = pa.StructArray.from_arrays(
        [
            pa.array([p.doc_id for p in flat], type=pa.string()),
            pa.array([p.text for p in flat], type=pa.string()),
            pa.array([p.title for p in flat], type=pa.string()),
            pa.array([p.score for p in flat], type=pa.float64()),
        ],
        fields=list(PASSAGE),
    )
    offsets_array = pa.array(offsets, type=pa.int32())
    column = pa.ListArray.from_arrays(offsets_array, passages, type=pa.list_(PASSAGE))
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
        with_fields(r, passages=tuple(passages[offsets[i] : offsets[i + 1]]))
        if hasattr(r, "passages")
        else r
        for i, r in enumerate(slim)
    ]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def with_fields(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace(obj, **changes)`` for the plain frozen result dataclasses, without
    its per-call introspection (it dominated a message's cost)."""
    cls = type(obj)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls) if f.init)
    values = {n: getattr(obj, n) for n in names}
    values.update(changes)
    return cls(**values)


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
