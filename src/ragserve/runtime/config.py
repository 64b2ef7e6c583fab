"""``ServerConfig``: how the runtime runs its workers, built once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragserve.retrieval.limits import DocumentLimits


@dataclass(frozen=True)
class ServerConfig:
    """Runtime knobs. ``in_process`` runs the engine and the index in the server's own process
    (tests, debugging); the default runs each in a persistent worker process.

    ``engine_kwargs`` go to ``LLMEngine`` as keyword arguments (``device``, ``max_num_seqs``,
    ``kv_cache_bytes``, ...). ``default_nprobe`` applies to retrieval nodes with
    ``nprobe=None`` (``None``: the index's own default).

    Every wait on a worker is bounded: a document call (upsert, delete) fails with a
    ``WorkerError`` (``timeout``) after ``call_timeout_s``; at most ``max_num_calls`` run at
    once (past it: ``overloaded``); a request waits at most ``call_timeout_s`` for one of the
    ``max_active_requests`` slots. Upserted documents are checked against
    ``document_limits`` first (``ValueError`` naming the field). ``health_stall_s``: a
    scheduler loop silent for longer makes ``Server.health()`` unhealthy.
    """

    in_process: bool = False
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    default_nprobe: int | None = None
    max_active_requests: int = 256
    queue_size: int = 64
    shm_slots: int = 32
    shm_slot_bytes: int = 1 << 20
    worker_start_timeout: float = 600.0
    max_node_runs: int = 256
    poll_timeout: float = 0.02
    transforms: tuple[Any, ...] = field(default=())
    call_timeout_s: float = 600.0
    max_num_calls: int = 16
    document_limits: DocumentLimits = field(default_factory=DocumentLimits)
    health_stall_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.engine_kwargs, dict):
            object.__setattr__(self, "engine_kwargs", tuple(sorted(self.engine_kwargs.items())))
        for name in ("call_timeout_s", "health_stall_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        names = (
            "max_active_requests",
            "queue_size",
            "shm_slots",
            "shm_slot_bytes",
            "max_num_calls",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
