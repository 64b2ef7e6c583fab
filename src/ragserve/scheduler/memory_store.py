"""``MemoryStore``: the per-session memory behind memory nodes, in memory only. Each append
drops the oldest entries past ``max_entries`` or ``max_bytes`` (UTF-8; a longer entry is cut
to its last ``max_bytes``) per session, and the least recently used session past
``max_sessions``."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass
class _Session:
    entries: deque
    num_bytes: int = 0


class MemoryStore:
    """Session id -> entries, oldest first; thread-safe. Bounds are checked by
    ``OperatorConfig``."""

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
