"""``OperatorConfig``: the server-side operators' bounds (function pool, session memory)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    """Knobs of the operators that run in the server process.

    - ``function_workers`` threads run function nodes (``CpuPool``); a call runs at most
      ``function_timeout_s`` seconds (a node's own ``timeout_s`` wins), then its request fails;
      past ``function_max_stuck`` timed-out calls still running, function nodes fail at once.
    - Memory nodes' ``MemoryStore``: ``memory_max_entries`` entries and ``memory_max_bytes``
      UTF-8 bytes per session, ``memory_max_sessions`` sessions; oldest dropped first.
    """

    function_workers: int = 4
    function_timeout_s: float = 30.0
    function_max_stuck: int = 16
    memory_max_entries: int = 64
    memory_max_bytes: int = 65536
    memory_max_sessions: int = 10000

    def __post_init__(self) -> None:
        if not 0 < self.function_timeout_s < float("inf"):
            raise ValueError(f"function_timeout_s must be > 0, got {self.function_timeout_s}")
        for name in (
            "function_workers",
            "function_max_stuck",
            "memory_max_entries",
            "memory_max_bytes",
            "memory_max_sessions",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
