"""The operators the scheduler runs itself: function nodes in the ``CpuPool``, memory nodes on
the ``MemoryStore``; ``OperatorConfig``: their bounds, and the retrieval worker's reranker."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ragserve.graph.checks import check_int
from ragserve.scheduler.messages import OperatorResult

logger = logging.getLogger(__name__)

DEFAULT_RERANKER = "embedding"
# ``module:factory``: a dotted module path and a (dotted) attribute inside it
RERANKER_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class OperatorConfig:
    """The ``CpuPool``'s (``function_*``) and ``MemoryStore``'s (``memory_*``) bounds, and
    ``reranker``: ``"embedding"`` (the embedder's cosine) or ``"module:factory"``, called as
    ``factory(embedder)`` at worker start (only its form is checked here)."""

    function_workers: int = 4
    function_timeout_s: float = 30.0
    function_max_stuck: int = 16
    memory_max_entries: int = 64
    memory_max_bytes: int = 65536
    memory_max_sessions: int = 10000
    reranker: str = DEFAULT_RERANKER

    def __post_init__(self) -> None:
        if not isinstance(self.reranker, str) or not (
            self.reranker == DEFAULT_RERANKER or RERANKER_SPEC.fullmatch(self.reranker)
        ):
            raise ValueError(
                f"reranker must be {DEFAULT_RERANKER!r} or 'module:factory', got {self.reranker!r}"
            )
        if not 0 < self.function_timeout_s < float("inf"):
            raise ValueError(f"function_timeout_s must be > 0, got {self.function_timeout_s}")
        for f in fields(self):
            if f.type == "int":  # counts and bounds, each >= 1
                check_int(f.name, getattr(self, f.name))


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
    """Function nodes' bounded thread pool; thread-safe ``submit``/``abort``, ``poll`` from one
    thread: an ``OperatorResult`` per finished call and a timeout error per call past its
    deadline. A timed-out call's thread (a Python thread cannot be killed) is written off and
    replaced, at most ``max_stuck`` at a time (past it, calls fail at once)."""

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
        out = [self._done.get_nowait() for _ in range(self._done.qsize())]  # the one reader
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


@dataclass
class _Session:
    entries: deque
    num_bytes: int = 0


class MemoryStore:
    """Memory nodes' sessions, in memory only: session id -> entries, oldest first;
    thread-safe. Each append drops the oldest entries past ``max_entries`` or ``max_bytes``
    (UTF-8; a longer entry is cut to its last ``max_bytes``) per session, and the least
    recently used session past ``max_sessions``."""

    def __init__(
        self, max_entries: int = 64, max_bytes: int = 65536, max_sessions: int = 10000
    ) -> None:
        self.max_entries, self.max_bytes, self.max_sessions = max_entries, max_bytes, max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, session_id: str) -> list[str]:
        _check_session(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return []
            self._sessions.move_to_end(session_id)
            return list(session.entries)

    def append(self, session_id: str, text: str) -> str:
        """Store ``text`` (cut to ``max_bytes``) as the newest entry; returns what was stored."""
        _check_session(session_id)
        if not isinstance(text, str):
            raise ValueError(f"memory text must be a string, got {type(text).__name__}")
        data = text.encode("utf-8")
        if len(data) > self.max_bytes:
            text = data[-self.max_bytes :].decode("utf-8", errors="ignore")
            data = text.encode("utf-8")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = self._sessions[session_id] = _Session(deque())
            self._sessions.move_to_end(session_id)
            session.entries.append(text)
            session.num_bytes += len(data)
            while len(session.entries) > self.max_entries or session.num_bytes > self.max_bytes:
                session.num_bytes -= len(session.entries.popleft().encode("utf-8"))
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return text

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._sessions) <= self.max_sessions
            for sid, s in self._sessions.items():
                actual = sum(len(e.encode("utf-8")) for e in s.entries)
                assert s.num_bytes == actual, f"session {sid!r}: {s.num_bytes} != {actual}"
                assert len(s.entries) <= self.max_entries and s.num_bytes <= self.max_bytes


def _check_session(session_id: object) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"memory session id must be a non-empty string, got {session_id!r}")
