"""``OperatorConfig``: the operators' knobs (function pool, session memory, the reranker)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ragserve.graph.checks import check_int

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
