"""The process executor's self-pipe: ``wake`` (any thread) interrupts a ``poll`` waiting on
the workers' pipes; it never blocks, and a late ``wake`` after ``close`` is harmless."""

from __future__ import annotations

import threading
from multiprocessing.connection import wait

from ragserve.runtime.executors import Waker


def test_wake_makes_the_waker_readable_until_drained() -> None:
    waker = Waker()
    try:
        assert wait([waker], 0.0) == []
        waker.wake()
        assert wait([waker], 0.0) == [waker]
        waker.drain()
        assert wait([waker], 0.0) == []
        for _ in range(100_000):  # far past the socket's buffer: never blocks, never raises
            waker.wake()
        waker.drain()
        assert wait([waker], 0.0) == []
    finally:
        waker.close()
    waker.wake()
    waker.close()


def test_a_wake_from_another_thread_ends_a_long_wait() -> None:
    waker = Waker()
    try:
        thread = threading.Timer(0.05, waker.wake)
        thread.start()
        assert wait([waker], 60.0) == [waker]
        thread.join()
    finally:
        waker.close()
