"""A shared-memory ring of fixed-size slots: numpy arrays cross processes without pickling.

The writer (a worker) takes a free slot — blocking when all are in flight, which is the data
plane's backpressure — copies its arrays in and sends a small ``ShmRef`` through its pipe.
The reader (the server) views the arrays in place, copies them out once and frees the slot.

    slot i:  [ array 0 bytes | array 1 bytes | ... ]  at  i * slot_bytes
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np


@dataclass(frozen=True)
class ShmRef:
    """Where a message's arrays lie: slot index and ``(dtype, shape, offset)`` per array."""

    slot: int
    arrays: tuple[tuple[str, tuple[int, ...], int], ...]


class ShmRing:
    """Owner side (server): creates the segment and the free-slot queue; ``close()`` unlinks."""

    def __init__(self, ctx, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=num_slots * slot_bytes)
        self.free = ctx.Queue()
        for i in range(num_slots):
            self.free.put(i)

    def handle(self) -> tuple[str, int, int, object]:
        """What a worker needs to attach (picklable at process start)."""
        return (self.shm.name, self.num_slots, self.slot_bytes, self.free)

    def read(self, ref: ShmRef) -> list[np.ndarray]:
        base = ref.slot * self.slot_bytes
        out = []
        for dtype, shape, offset in ref.arrays:
            view = np.ndarray(shape, dtype=dtype, buffer=self.shm.buf, offset=base + offset)
            out.append(view.copy())
            del view
        self.free.put(ref.slot)
        return out

    def close(self) -> None:
        # NOTE: the free-slot queue owns semaphores; closing it lets them be released when the
        # ring is dropped (a restarted worker's old ring would otherwise leak them).
        self.free.cancel_join_thread()
        self.free.close()
        try:
            self.shm.close()
            self.shm.unlink()
        except (FileNotFoundError, BufferError):
            pass


class ShmWriter:
    """Worker side: attaches to a ring by its handle."""

    def __init__(self, handle: tuple[str, int, int, object]) -> None:
        name, self.num_slots, self.slot_bytes, self.free = handle
        # NOTE: spawned workers share the server's resource tracker, which already tracks the
        # segment; the server unlinks it in ``ShmRing.close``.
        self.shm = shared_memory.SharedMemory(name=name)

    def write(self, arrays: list[np.ndarray], timeout: float | None = None) -> ShmRef | None:
        """Copy ``arrays`` into a free slot; ``None`` if they do not fit in one slot."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if sum(_aligned(a.nbytes) for a in arrays) > self.slot_bytes:
            return None
        try:
            slot = self.free.get(timeout=timeout)
        except queue.Empty:
            return None
        base, offset, specs = slot * self.slot_bytes, 0, []
        for a in arrays:
            dst = np.ndarray(a.shape, dtype=a.dtype, buffer=self.shm.buf, offset=base + offset)
            dst[...] = a
            del dst
            specs.append((a.dtype.str, tuple(a.shape), offset))
            offset += _aligned(a.nbytes)
        return ShmRef(slot, tuple(specs))


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64
