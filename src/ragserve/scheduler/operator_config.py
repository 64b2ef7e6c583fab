"""``OperatorConfig``: the operators' knobs (function pool, session memory, the reranker)."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_RERANKER = "embedding"
# ``module:factory``: a dotted module path and a (dotted) attribute inside it
RERANKER_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class OperatorConfig:
    """Knobs of the operators that run in the server process.

    - ``function_workers`` threads run function nodes (``CpuPool``); a call runs at most
      ``function_timeout_s`` seconds (a node's own ``timeout_s`` wins), then its request fails;
      past ``function_max_stuck`` timed-out calls still running, function nodes fail at once.
    - Memory nodes' ``MemoryStore``: ``memory_max_entries`` entries and ``memory_max_bytes``
      UTF-8 bytes per session, ``memory_max_sessions`` sessions; oldest dropped first.
    - ``reranker``: what rerank nodes score with, built by the retrieval worker at start
      (``retrieval.rerank.load_reranker``): ``"embedding"`` (the index embedder's cosine) or
      ``"module:factory"``, ``factory(embedder)`` returning a reranker (``score(query,
      texts)``); only its form is checked here, the import at worker start.
    """

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
