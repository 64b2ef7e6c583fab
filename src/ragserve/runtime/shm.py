"""A shared-memory ring of fixed-size slots carrying Arrow IPC streams from a worker (the one
writer) to the server (the one reader); docs/architecture.md "Data plane".

    [ flags: 1 byte per slot | pad to 64 ] [ slot 0 ] [ slot 1 ] ...   slot i at
    header + i * slot_bytes:  [ Arrow IPC stream (schema, one record batch) | unused ]

Only the writer sets a flag 0 -> 1 and only the reader 1 -> 0, so no lock is needed; the
``ShmRef`` goes through a pipe after the slot is written, which orders the writes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory

import pyarrow as pa


@dataclass(frozen=True)
class ShmRef:
    """An Arrow IPC stream of ``num_bytes`` at the start of shared-memory slot ``slot``."""

    slot: int
    num_bytes: int


@dataclass(frozen=True)
class InlineArrow:
    """An Arrow IPC stream sent through the pipe (it did not fit a slot, or none was free)."""

    data: bytes


ArrowPayload = ShmRef | InlineArrow


def ipc_stream(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def read_stream(buf: pa.Buffer) -> pa.RecordBatch:
    """The one record batch in ``buf``, in place; ``ValueError`` if it is no IPC stream."""
    try:
        reader = pa.ipc.open_stream(buf)
        batch = reader.read_next_batch()
    except (pa.ArrowInvalid, StopIteration, OSError) as exc:
        raise ValueError(f"the payload is not an Arrow IPC stream: {exc}") from None
    return batch


class ShmRing:
    """Owner side (server): creates the segment and the free-slot queue; ``close()`` unlinks."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = _header_bytes(num_slots) + num_slots * slot_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.shm.buf[:num_slots] = bytes(num_slots)

    def handle(self) -> tuple[str, int, int]:
        return (self.shm.name, self.num_slots, self.slot_bytes)

    def slot_offset(self, slot: int) -> int:
        return _header_bytes(self.num_slots) + slot * self.slot_bytes

    @property
    def num_free(self) -> int:
        return bytes(self.shm.buf[: self.num_slots]).count(0)

    @contextlib.contextmanager
    def read(self, payload: ArrowPayload) -> Iterator[pa.RecordBatch]:
        """The batch of ``payload``, read in place; its slot is freed when the block ends (also
        on a ``ValueError``: a bad reference or no Arrow stream)."""
        if isinstance(payload, InlineArrow):
            yield read_stream(pa.py_buffer(payload.data))
            return
        if not 0 <= payload.slot < self.num_slots:
            raise ValueError(f"slot {payload.slot} is outside the ring of {self.num_slots}")
        try:
            if not 0 < payload.num_bytes <= self.slot_bytes:
                raise ValueError(
                    f"a payload of {payload.num_bytes} bytes does not fit a slot of "
                    f"{self.slot_bytes}"
                )
            base = self.slot_offset(payload.slot)
            view = self.shm.buf[base : base + payload.num_bytes]
            try:
                yield read_stream(pa.py_buffer(view))
            finally:
                # NOTE: the batch (and any array taken from it) must be gone by now, else
                # releasing the view raises; the slot is reused only after this.
                with contextlib.suppress(BufferError):
                    view.release()
        finally:
            self.shm.buf[payload.slot] = 0

    def close(self) -> None:
        try:
            self.shm.close()
            self.shm.unlink()
        except (FileNotFoundError, BufferError):
            pass


class ShmWriter:
    """Worker side: attaches to a ring by its handle."""

    def __init__(self, handle: tuple[str, int, int]) -> None:
        name, self.num_slots, self.slot_bytes = handle
        # NOTE: spawned workers share the server's resource tracker, which already tracks the
        # segment; the server unlinks it in ``ShmRing.close``.
        self.shm = shared_memory.SharedMemory(name=name)

    def write(self, stream: pa.Buffer, timeout: float | None = None) -> ArrowPayload:
        """``stream`` in a free slot; inline when larger than a slot or none freed in time."""
        size = stream.size
        slot = self._free_slot(timeout) if size <= self.slot_bytes else None
        if slot is None:
            return InlineArrow(stream.to_pybytes())
        base = _header_bytes(self.num_slots) + slot * self.slot_bytes
        self.shm.buf[base : base + size] = memoryview(stream).cast("B")
        self.shm.buf[slot] = 1
        return ShmRef(slot, size)

    def _free_slot(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slot = bytes(self.shm.buf[: self.num_slots]).find(0)
            if slot >= 0:
                return slot
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.0005)


def _header_bytes(num_slots: int) -> int:
    return (num_slots + 63) // 64 * 64
