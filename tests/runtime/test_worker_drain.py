"""A worker's inbox reads (``workers._drain``): every message, in order, whether the read
waits or not; the server's liveness checked on every blocking read and at most every
``PARENT_CHECK_S`` between engine steps (``_ParentWatch``)."""

from __future__ import annotations

import multiprocessing
import pickle
import time

from ragserve.runtime import workers
from ragserve.runtime.wire import ShutdownMsg


def test_drain_returns_every_message_in_order() -> None:
    inbox = multiprocessing.get_context("spawn").Queue(8)
    try:
        assert workers._drain(inbox, block=False) == []
        for i in range(3):
            inbox.put(pickle.dumps(("msg", i)))
        deadline = time.monotonic() + 5
        while inbox.empty() and time.monotonic() < deadline:
            time.sleep(0.01)  # the feeder thread writes to the pipe
        time.sleep(0.1)
        got = workers._drain(inbox, block=False)
        got += workers._drain(inbox, block=True) if len(got) < 3 else []
        assert got == [("msg", 0), ("msg", 1), ("msg", 2)]
        assert workers._drain(inbox, block=False) == []
    finally:
        inbox.close()
        inbox.join_thread()


class _Parent:
    def __init__(self) -> None:
        self.alive, self.checks = True, 0

    def is_alive(self) -> bool:
        self.checks += 1
        return self.alive


def test_parent_checked_on_blocking_reads_and_at_most_every_interval(monkeypatch) -> None:
    parent = _Parent()
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: parent)
    watch = workers._ParentWatch(interval_s=3600.0)
    assert not watch.is_gone(block=False) and parent.checks == 1  # the first read checks
    assert not any(watch.is_gone(block=False) for _ in range(100)) and parent.checks == 1
    parent.alive = False
    assert not watch.is_gone(block=False)  # within the interval: not looked at
    assert watch.is_gone(block=True) and parent.checks == 2  # a blocking read always looks
    every = workers._ParentWatch(interval_s=0.0)  # 0: every read checks (the old behaviour)
    assert every.is_gone(block=False) and every.is_gone(block=False) and parent.checks == 4


def test_drain_says_shutdown_once_the_server_is_gone(monkeypatch) -> None:
    parent = _Parent()
    parent.alive = False
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: parent)
    monkeypatch.setattr(workers, "_parent", workers._ParentWatch(workers.PARENT_CHECK_S))
    inbox = multiprocessing.get_context("spawn").Queue(8)
    try:
        assert workers._drain(inbox, block=False) == [ShutdownMsg()]
    finally:
        inbox.close()
        inbox.join_thread()
