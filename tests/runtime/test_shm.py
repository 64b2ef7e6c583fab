"""The shared-memory ring: arrays round-trip exactly; a full ring is backpressure."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from ragserve.runtime.shm import ShmRing, ShmWriter
from ragserve.runtime.workers import _send_generation, unpack_generation
from ragserve.scheduler import GenerationUpdate


def _ring(slots: int = 2, slot_bytes: int = 4096) -> tuple[ShmRing, ShmWriter]:
    ring = ShmRing(mp.get_context("spawn"), slots, slot_bytes)
    return ring, ShmWriter(ring.handle())


def test_arrays_round_trip_and_free_their_slot() -> None:
    ring, writer = _ring()
    try:
        a = np.arange(12, dtype=np.int64).reshape(3, 4)
        b = np.linspace(0, 1, 5, dtype=np.float32)
        c = np.zeros((0,), dtype=np.int64)
        for _ in range(5):  # more messages than slots: each read frees its slot
            ref = writer.write([a, b, c], timeout=1.0)
            assert ref is not None
            out = ring.read(ref)
            assert [x.dtype for x in out] == [a.dtype, b.dtype, c.dtype]
            np.testing.assert_array_equal(out[0], a)
            np.testing.assert_array_equal(out[1], b)
            assert out[2].shape == (0,)
    finally:
        ring.close()


def test_full_ring_and_oversized_messages_return_none() -> None:
    ring, writer = _ring(slots=2, slot_bytes=256)
    try:
        small = [np.ones(4, dtype=np.int64)]
        refs = [writer.write(small, timeout=1.0) for _ in range(2)]
        assert all(r is not None for r in refs)
        assert writer.write(small, timeout=0.05) is None  # every slot in flight
        ring.read(refs[0])
        assert writer.write(small, timeout=1.0) is not None
        assert writer.write([np.ones(1000, dtype=np.int64)], timeout=0.05) is None
    finally:
        ring.close()


class _Conn:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def test_generation_updates_cross_with_token_ids_in_shared_memory() -> None:
    ring, writer = _ring()
    try:
        updates = [
            GenerationUpdate("a", "he", (5, 6), False, prompt_token_ids=(1, 2, 3)),
            GenerationUpdate("b", "llo", (7,), True, "stop", final_text="hello"),
        ]
        conn = _Conn()
        _send_generation(conn, writer, updates, {"running": 1})
        kind, slim, ref, stats = conn.sent[0]
        assert kind == "gen" and all(u.new_token_ids == () for u in slim)
        assert stats == {"running": 1}  # the engine stats ride on the update message
        assert unpack_generation(slim, ring.read(ref)) == updates
    finally:
        ring.close()
