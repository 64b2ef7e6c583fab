"""``CpuPool``: function nodes' bounded thread pool. ``poll`` returns an ``OperatorResult`` per
finished call and a timeout error per call past its deadline; a timed-out call's thread (a
Python thread cannot be killed) is written off and replaced, at most ``max_stuck`` at a time
(past it, calls fail at once)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ragserve.scheduler.messages import OperatorResult

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    task_id: str
    fn: Callable[[Any], Any]
    arg: Any
    timeout_s: float
    started_at: float | None = None  # set by the worker thread that runs it
    abandoned: bool = False  # aborted or timed out: its result is dropped
    timed_out: bool = False  # its thread was written off (a replacement runs)


class CpuPool:
    """Thread-safe ``submit``/``abort``; ``poll`` from one thread. Bounds are checked by
    ``OperatorConfig``."""

    def __init__(self, num_workers: int = 4, default_timeout_s: float = 30.0, max_stuck: int = 16):
        self.num_workers = num_workers
        self.default_timeout_s = default_timeout_s
        self.max_stuck = max_stuck
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}  # submitted, not yet reported
        self._num_stuck = 0  # threads written off (still running a timed-out call)
        for _ in range(num_workers):
            self._spawn()

    def submit(self, task_id: str, fn: Callable[[Any], Any], arg: Any, timeout_s: float | None):
        call = _Call(task_id, fn, arg, timeout_s or self.default_timeout_s)
        with self._lock:
            if self._num_stuck >= self.max_stuck:
                reason = f"the function pool is exhausted ({self._num_stuck} calls timed out)"
                self._done.put(OperatorResult(task_id, error=reason, error_kind="internal"))
                return
            self._calls[task_id] = call
        self._queue.put(call)

    def abort(self, task_ids: list[str]) -> None:
        with self._lock:
            for tid in task_ids:
                call = self._calls.pop(tid, None)
                if call is not None:
                    call.abandoned = True

    def has_work(self) -> bool:
        return bool(self._calls) or not self._done.empty()

    def poll(self) -> list[OperatorResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        with self._lock:
            late = [
                c
                for c in self._calls.values()
                if c.started_at is not None and now - c.started_at > c.timeout_s
            ]
            for call in late:
                del self._calls[call.task_id]
                call.abandoned = call.timed_out = True
                self._num_stuck += 1
        for call in late:
            logger.warning("function call %s timed out after %g s", call.task_id, call.timeout_s)
            message = f"function timed out after {call.timeout_s:g} s"
            out.append(OperatorResult(call.task_id, error=message, error_kind="internal"))
            self._spawn()  # the stuck thread's replacement
        return out

    def close(self) -> None:
        for _ in range(self.num_workers + self._num_stuck):
            self._queue.put(None)

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="ragserve-function", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            with self._lock:
                if call.abandoned:
                    continue
                call.started_at = time.monotonic()
            try:
                result = OperatorResult(call.task_id, call.fn(call.arg))
            except Exception as exc:
                logger.info("function call %s raised %s", call.task_id, type(exc).__name__)
                error = f"function raised {type(exc).__name__}: {exc}"
                result = OperatorResult(call.task_id, error=error, error_kind="internal")
            with self._lock:
                if call.timed_out:
                    self._num_stuck -= 1
                    return  # written off: its replacement already runs
                if call.abandoned:
                    continue
                del self._calls[call.task_id]
            self._done.put(result)
