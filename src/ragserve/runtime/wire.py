"""What crosses between the server and its worker processes (docs/architecture.md "Data
plane"): the typed messages, the fixed tables of methods a call message may name, and a results
message's rows both ways: ``Outbox`` (worker side) sends them as an Arrow batch in a
shared-memory slot when ``uses_arrow``, else pickled in the message; ``read_results`` (server
side) reads either."""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa

from ragserve.graph import Passage
from ragserve.runtime.errors import error_kind_of, error_result, failed_update
from ragserve.runtime.shm import ArrowPayload, ShmRing, ShmWriter, ipc_stream
from ragserve.scheduler import GenerationTask, GenerationUpdate, RetrievalTask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubmitMsg:
    tasks: tuple[GenerationTask | RetrievalTask, ...]


@dataclass(frozen=True)
class AbortGenerationMsg:
    task_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallMsg:
    """Run ``runner.<method>(*args)`` (``CALLS``) in the worker, between engine steps or
    searches; the answer is a ``CallReplyMsg`` with the same ``token``."""

    token: int
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class ShutdownMsg:
    pass


@dataclass(frozen=True)
class ReadyMsg:
    kind: str


@dataclass(frozen=True)
class FatalMsg:
    traceback: str


@dataclass(frozen=True)
class EngineStatsMsg:
    stats: dict[str, Any]


@dataclass(frozen=True)
class GenerationResultsMsg:
    """The ``GenerationUpdate``s of ``task_ids``: one row each in ``payload``, or, when
    ``payload`` is ``None``, in ``updates`` (a small message); ``stats``: the engine's, or
    ``None``."""

    task_ids: tuple[str, ...]
    payload: ArrowPayload | None
    stats: dict[str, Any] | None = None
    updates: tuple[Any, ...] = ()


@dataclass(frozen=True)
class RetrievalResultsMsg:
    """``results`` (``RetrievalResult``, ``StagedRetrievalResult``, ``RetrievalPartial``,
    ``OperatorResult``) without their passages, which ``payload`` holds, one row per result;
    when ``payload`` is ``None`` (a small message) the results carry their passages."""

    results: tuple[Any, ...]
    payload: ArrowPayload | None


@dataclass(frozen=True)
class WireError:
    kind: str  # a ``WorkerError`` kind
    message: str


@dataclass(frozen=True)
class CallReplyMsg:
    """The value a ``CallMsg`` returned (pickled: any Python value), or its error."""

    token: int
    value: Any = None
    error: WireError | None = None


RETRIEVAL_CALLS = (
    "add_documents",
    "delete_documents",
    "embed",
    "set_gpu_tier",
    "drop_gpu_tier",
    "gpu_tier_stats",
)
CALLS = {"retrieval": RETRIEVAL_CALLS, "generation": ("set_kv_reuse",)}  # what a caller may run


def check_call(method: str, kind: str = "retrieval") -> Callable[..., Any]:
    """``fn(runner, *args)`` running ``runner.<method>(*args)`` for a ``method`` listed in
    ``CALLS[kind]``; ``ValueError`` naming it if not."""
    if method not in CALLS[kind]:
        raise ValueError(
            f"method {method!r} is not a {kind} call; choose one of {', '.join(CALLS[kind])}"
        )
    return lambda runner, *args: getattr(runner, method)(*args)


def encode(msg: Any) -> bytes:
    """``msg`` pickled now: its errors raise here, in the sender."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def drain(inbox: Any, timeout: float | None) -> list[Any]:
    """Every message queued in ``inbox`` (unpickled), waiting up to ``timeout`` seconds for the
    first (``None``: not at all)."""
    msgs = []
    try:
        msgs.append(inbox.get_nowait() if timeout is None else inbox.get(timeout=timeout))
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return [pickle.loads(m) if isinstance(m, bytes) else m for m in msgs]


ROW_BYTES = 64  # a row's fixed part in the estimate (ids, flags, offsets)
SLOT_WAIT_S = 1.0  # a result waits this long for a free shared-memory slot, then goes inline
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
PASSAGE = pa.struct(
    [
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("title", pa.string()),
        ("score", pa.float64()),
    ]
)
RETRIEVAL_SCHEMA = pa.schema([("passages", pa.list_(PASSAGE))])


def uses_arrow(num_bytes: int, small_message_bytes: int, slot_bytes: int) -> bool:
    return small_message_bytes <= num_bytes <= slot_bytes


def generation_bytes(updates: list[Any]) -> int:
    """The estimated payload size of ``updates``."""
    text = sum(len(u.text_delta) + len(u.final_text or "") + len(u.error or "") for u in updates)
    ids = sum(len(u.new_token_ids) + len(u.prompt_token_ids or ()) for u in updates)
    return ROW_BYTES * len(updates) + text + 8 * ids


def retrieval_bytes(results: list[Any]) -> int:
    """The estimated payload size of ``results`` (an operator result: its fixed part only)."""
    passages = [p for r in results for p in getattr(r, "passages", ())]
    return ROW_BYTES * len(results) + sum(
        8 + len(p.doc_id) + len(p.text) + len(p.title or "") for p in passages
    )


class Outbox:
    """A worker's way out: typed messages to its pipe ``conn``. A result that cannot be sent
    (unpicklable, past ``max_message_bytes``) is replaced by errors for what it carried."""

    def __init__(
        self, conn: Any, writer: ShmWriter, max_message_bytes: int, small_message_bytes: int
    ) -> None:
        self.conn = conn
        self.writer = writer
        self.max_message_bytes = max_message_bytes
        self.small_message_bytes = small_message_bytes

    def send(self, msg: Any, fallback: Callable[[str], Any]) -> None:
        try:
            data = encode(msg)
        except Exception as exc:
            logger.error("a %s cannot be pickled (%s); sending errors instead", type(msg), exc)
            data = encode(fallback(f"the result cannot be sent back: {type(exc).__name__}"))
        if len(data) > self.max_message_bytes:
            reason = (
                f"the result cannot be sent back: its message of {len(data)} bytes exceeds "
                f"max_message_bytes ({self.max_message_bytes})"
            )
            logger.error("%s", reason)
            data = encode(fallback(reason))
        self.conn.send_bytes(data)

    def send_stats(self, stats: dict[str, Any]) -> None:
        self.conn.send(EngineStatsMsg(stats))

    def reply(self, msg: CallMsg, value: Any, exc: Exception | None) -> None:
        error = None
        if exc is not None:
            error = WireError(error_kind_of(exc), f"{type(exc).__name__}: {exc}")
        fallback = lambda err: CallReplyMsg(msg.token, error=WireError("internal", err))
        self.send(CallReplyMsg(msg.token, value, error), fallback)

    def send_generation(self, updates: list, stats: dict | None) -> None:
        task_ids = tuple(u.task_id for u in updates)

        def failed(reason: str) -> GenerationResultsMsg:
            errors = tuple(failed_update(t, reason) for t in task_ids)
            return GenerationResultsMsg(task_ids, None, None, errors)

        if not self._uses_arrow(generation_bytes(updates)):
            self.send(GenerationResultsMsg(task_ids, None, stats, tuple(updates)), failed)
        elif (payload := self._payload(lambda: generation_batch(updates), failed)) is not None:
            self.send(GenerationResultsMsg(task_ids, payload, stats), failed)

    def send_retrieval(self, results: list) -> None:
        """Operator results carry no passages and ride in the message as they are."""

        def failed(reason: str) -> RetrievalResultsMsg:
            errors = (error_result(r, reason, "internal") for r in results)
            return RetrievalResultsMsg(tuple(errors), None)

        if not self._uses_arrow(retrieval_bytes(results)):
            self.send(RetrievalResultsMsg(tuple(results), None), failed)
        elif (payload := self._payload(lambda: retrieval_batch(results), failed)) is not None:
            slim = (with_fields(r, passages=()) if hasattr(r, "passages") else r for r in results)
            self.send(RetrievalResultsMsg(tuple(slim), payload), failed)

    def _uses_arrow(self, num_bytes: int) -> bool:
        return uses_arrow(num_bytes, self.small_message_bytes, self.writer.slot_bytes)

    def _payload(self, batch: Callable[[], pa.RecordBatch], failed: Callable[[str], Any]) -> Any:
        """The batch written to the ring (or inline); ``None`` once ``failed(reason)`` has been
        sent instead."""
        try:
            stream = ipc_stream(batch())
            if stream.size > self.max_message_bytes:
                raise ValueError(
                    f"its payload of {stream.size} bytes exceeds max_message_bytes "
                    f"({self.max_message_bytes})"
                )
        except (ValueError, OverflowError, TypeError, pa.ArrowException) as exc:
            self.send(failed(f"the result cannot be sent back: {exc}"), failed)
            return None
        return self.writer.write(stream, timeout=SLOT_WAIT_S)


def read_results(msg: GenerationResultsMsg | RetrievalResultsMsg, ring: ShmRing) -> list[Any]:
    """The updates / results of ``msg``: its own rows, or its payload read in place from
    ``ring`` (a slot is freed here). ``ValueError`` for rows that do not match the message."""
    is_gen = isinstance(msg, GenerationResultsMsg)
    if msg.payload is None:
        rows = list(msg.updates) if is_gen else list(msg.results)
        if is_gen and tuple(u.task_id for u in rows) != msg.task_ids:
            raise ValueError("the message's updates are not those of its task ids")
        return rows
    read = read_generation if is_gen else attach_retrieval
    with ring.read(msg.payload) as batch:
        rows = read(msg.task_ids if is_gen else msg.results, batch)
        del batch
    return rows


def generation_batch(updates: list[GenerationUpdate]) -> pa.RecordBatch:
    columns = []
    for field in GENERATION_SCHEMA:
        values = [getattr(u, field.name) for u in updates]
        if field.type == TOKENS:
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
    """The ``GenerationUpdate``s of ``batch`` (``ValueError`` unless those of ``task_ids``)."""
    _check(batch, GENERATION_SCHEMA, len(task_ids))
    columns = [
        _token_rows(column) if field.type == TOKENS else column.to_pylist()
        for field, column in zip(GENERATION_SCHEMA, batch.columns, strict=True)
    ]
    if columns[0] != list(task_ids):
        raise ValueError("the payload's task ids are not the message's")
    columns[2] = [ids or () for ids in columns[2]]
    return [GenerationUpdate(*row) for row in zip(*columns, strict=True)]


def retrieval_batch(results: list[Any]) -> pa.RecordBatch:
    """The passages of ``results``, one row each (empty for a result without passages)."""
    rows = [getattr(r, "passages", ()) for r in results]
    flat = [p for row in rows for p in row]
    offsets = list(itertools.accumulate((len(row) for row in rows), initial=0))
    passages = pa.StructArray.from_arrays(
        [pa.array([getattr(p, f.name) for p in flat], type=f.type) for f in PASSAGE],
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
    values = [column.values.field(i).to_pylist() for i in range(4)]
    passages = [Passage(*row) for row in zip(*values, strict=True)]
    return [
        with_fields(r, passages=tuple(passages[offsets[i] : offsets[i + 1]]))
        if hasattr(r, "passages")
        else r
        for i, r in enumerate(slim)
    ]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def with_fields(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` without its per-call introspection (it dominated a message)."""
    cls = type(obj)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls) if f.init)
    values = {n: getattr(obj, n) for n in names}
    values.update(changes)
    return cls(**values)


def _token_rows(column: pa.ListArray) -> list[tuple[int, ...] | None]:
    offsets = column.offsets.to_numpy()
    ids = column.values.to_numpy(zero_copy_only=True).tolist()
    valid = column.is_valid().to_pylist()
    return [
        tuple(ids[offsets[i] : offsets[i + 1]]) if valid[i] else None for i in range(len(column))
    ]


def _check(batch: pa.RecordBatch, schema: pa.Schema, num_rows: int) -> None:
    """``ValueError`` unless ``batch`` has ``schema``, ``num_rows`` and valid buffers (a corrupt
    payload must fail here, not crash the reader)."""
    if not batch.schema.equals(schema):
        raise ValueError(f"the payload's schema is {batch.schema}, expected {schema}")
    if batch.num_rows != num_rows:
        raise ValueError(f"the payload has {batch.num_rows} rows for {num_rows} results")
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"the payload is corrupt: {exc}") from None
