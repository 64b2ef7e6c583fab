"""The data plane: typed messages round-trip; token ids and passages cross as Arrow batches in
the shared-memory ring, read in place; a full ring, an oversize or a corrupt payload never
hangs and fails clearly."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest

from ragserve.graph import Passage
from ragserve.runtime.shm import InlineArrow, ShmRef, ShmRing, ShmWriter, ipc_stream
from ragserve.runtime.wire import (
    AbortGenerationMsg,
    CallMsg,
    CallReplyMsg,
    GenerationResultsMsg,
    Outbox,
    RetrievalResultsMsg,
    SubmitMsg,
    WireError,
    attach_retrieval,
    check_call,
    encode,
    generation_batch,
    read_generation,
    read_results,
    retrieval_batch,
)
from ragserve.scheduler import (
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
)
from ragserve.scheduler.messages import RetrievalPartial, StagedRetrievalResult

UPDATES = [
    GenerationUpdate("a", "he", (5, 6), False, prompt_token_ids=(1, 2, 3)),
    GenerationUpdate("b", "llo", (7,), True, "stop", final_text="hello"),
    GenerationUpdate("c", "", (), True, "error", error="boom", error_kind="internal"),
]
RESULTS = [
    RetrievalResult("r0", (Passage("d1", "one", "T", 0.5), Passage("d2", "twé", None, 0.25))),
    RetrievalResult("r1", (), "bad filter", error_kind="bad_request"),
    StagedRetrievalResult(
        "r2", (Passage("d3", "three", "X", 1.0),), hit_clusters=(4,), num_substages=3
    ),
    RetrievalPartial("r3", (Passage("d4", "", "", None),), 2),
]


def _ring(slots: int = 2, slot_bytes: int = 4096) -> tuple[ShmRing, ShmWriter]:
    ring = ShmRing(slots, slot_bytes)
    return ring, ShmWriter(ring.handle())


class _Conn:
    def __init__(self) -> None:
        self.sent: list = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(pickle.loads(data))


def test_messages_round_trip_through_pickle() -> None:
    task = GenerationTask("g", "hi", GenerationParams(max_tokens=3), history=(("system", "s"),))
    msgs = [
        SubmitMsg((task,)),
        AbortGenerationMsg(("g",)),
        SubmitMsg((RetrievalTask("r", "q", 2, filter={"a": 1}),)),
        CallMsg(7, "embed", (["x"],)),
        CallReplyMsg(7, error=WireError("timeout", "slow")),
        GenerationResultsMsg(("a", "b"), ShmRef(1, 64), {"running": 1}),
        RetrievalResultsMsg(tuple(RESULTS), InlineArrow(b"x")),
    ]
    for msg in msgs:
        assert pickle.loads(encode(msg)) == msg


def test_calls_dispatch_through_a_fixed_table() -> None:
    assert check_call("embed") is not None
    with pytest.raises(ValueError, match="'__init__' is not a retrieval call"):
        check_call("__init__")


def test_results_cross_the_ring_and_are_read_in_place() -> None:
    ring, writer = _ring(slot_bytes=1 << 16)
    conn = _Conn()
    outbox = Outbox(conn, writer, max_message_bytes=1 << 20, small_message_bytes=0)
    try:
        for _ in range(5):  # more messages than slots: each read frees its slot
            outbox.send_generation(UPDATES, {"running": 1})
            outbox.send_retrieval(RESULTS)
            _read_in_place(ring, conn.sent.pop(0))
            _read_in_place(ring, conn.sent.pop(0))
        assert ring.num_free == 2
    finally:
        ring.close()


def _read_in_place(ring: ShmRing, msg) -> None:
    assert isinstance(msg.payload, ShmRef)
    is_gen = isinstance(msg, GenerationResultsMsg)
    slim = msg.task_ids if is_gen else msg.results
    assert is_gen or all(not r.passages for r in slim)  # the passages are in the payload
    with ring.read(msg.payload) as batch:
        lo = pa.py_buffer(ring.shm.buf).address + ring.slot_offset(msg.payload.slot)
        addresses = [b.address for c in batch.columns for b in c.buffers() if b and b.size]
        assert addresses and all(lo <= a < lo + msg.payload.num_bytes for a in addresses)
        out = (read_generation if is_gen else attach_retrieval)(slim, batch)
        del batch
    assert out == (UPDATES if is_gen else RESULTS)


def test_a_full_ring_or_a_large_payload_goes_inline() -> None:
    ring, writer = _ring(slots=1, slot_bytes=4096)
    try:
        small = ipc_stream(generation_batch(UPDATES[:1]))
        first = writer.write(small, timeout=1.0)
        assert isinstance(first, ShmRef)
        assert isinstance(writer.write(small, timeout=0.05), InlineArrow)  # no slot free
        with ring.read(first):
            pass
        assert isinstance(writer.write(small, timeout=1.0), ShmRef)
        big = [GenerationUpdate("x", "", tuple(range(1000)), False)]
        inline = writer.write(ipc_stream(generation_batch(big)), timeout=1.0)
        assert isinstance(inline, InlineArrow)
        with ring.read(inline) as batch:
            assert read_generation(("x",), batch) == big
    finally:
        ring.close()


def test_oversize_results_fail_their_tasks_with_a_clear_error() -> None:
    ring, writer = _ring()
    conn = _Conn()
    try:
        Outbox(conn, writer, max_message_bytes=2048, small_message_bytes=0).send_retrieval(
            [RetrievalResult("big", (Passage("d", "x" * 10_000),))]
        )
        (msg,) = conn.sent
        assert msg.payload is None  # the errors ride in the message
        (result,) = read_results(msg, ring)
        assert result.task_id == "big" and result.passages == ()
        assert "exceeds max_message_bytes (2048)" in result.error
        for small in (0, 1 << 20):  # Arrow (it fits a slot), then pickled: the same bound
            Outbox(conn, writer, 2048, small).send_retrieval(
                [RetrievalResult("mid", (Passage("d", "x" * 1500), Passage("e", "y" * 1500)))]
            )
            (result,) = read_results(conn.sent.pop(), ring)
            assert "exceeds max_message_bytes (2048)" in result.error and not result.passages
    finally:
        ring.close()


def _read(ring: ShmRing, payload, attach=None, slim: tuple = ()) -> None:
    with ring.read(payload) as batch:
        if attach is not None:
            attach(slim, batch)


def test_corrupt_payloads_raise_and_free_their_slot() -> None:
    ring, writer = _ring(slots=1)
    try:
        ref = writer.write(ipc_stream(retrieval_batch(RESULTS)), timeout=1.0)
        base = ring.slot_offset(ref.slot)
        ring.shm.buf[base : base + 16] = b"\xff" * 16  # no longer an Arrow stream
        with pytest.raises(ValueError, match="not an Arrow IPC stream"):
            _read(ring, ref)
        assert ring.num_free == 1
        ref = writer.write(ipc_stream(retrieval_batch(RESULTS)), timeout=1.0)
        assert isinstance(ref, ShmRef)  # the slot came back
        with pytest.raises(ValueError, match="rows for 2 results") as info:
            _read(ring, ref, attach_retrieval, tuple(RESULTS[:2]))
        del info  # NOTE: its traceback holds the batch, whose buffers lie in the slot
        inline = InlineArrow(ipc_stream(retrieval_batch(RESULTS)).to_pybytes())
        with pytest.raises(ValueError, match="schema"):
            _read(ring, inline, read_generation, ("a", "b", "c"))
        with pytest.raises(ValueError, match="outside the ring"):
            _read(ring, ShmRef(5, 16))
        ref = writer.write(ipc_stream(retrieval_batch(RESULTS)), timeout=1.0)
        assert ring.num_free == 0
        with pytest.raises(ValueError, match="does not fit a slot"):
            _read(ring, ShmRef(ref.slot, ring.slot_bytes + 1))
        assert ring.num_free == 1
    finally:
        ring.close()


def test_operator_results_cross_beside_retrieval_results() -> None:
    # operator results (embed / rerank / upsert nodes) carry no passages; a batch mixing them
    # with retrieval results once killed the retrieval worker (TypeError in the outbox)
    from ragserve.scheduler.messages import OperatorResult

    mixed = [OperatorResult("op-1", value=[0.5, 0.25]), *RESULTS, OperatorResult("op-2", error="x")]
    ring, writer = _ring(slot_bytes=1 << 16)
    conn = _Conn()
    try:
        Outbox(conn, writer, max_message_bytes=1 << 20, small_message_bytes=0).send_retrieval(mixed)
        msg = conn.sent.pop(0)
        with ring.read(msg.payload) as batch:
            out = attach_retrieval(msg.results, batch)
            del batch
        assert out == mixed
    finally:
        ring.close()
