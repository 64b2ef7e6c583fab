"""``ServerConfig``: how the runtime runs its workers, built once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragserve.scheduler.cosched import CoScheduleConfig


@dataclass(frozen=True)
class ServerConfig:
    """Runtime knobs. ``in_process`` runs the engine and the index in the server's own process
    (tests, debugging); the default runs each in a persistent worker process.

    ``engine_kwargs`` go to ``LLMEngine`` as keyword arguments (``device``, ``max_num_seqs``,
    ``kv_cache_bytes``, ...). ``default_nprobe`` applies to retrieval nodes with
    ``nprobe=None`` (``None``: the index's own default).

    ``cosched`` is data (which co-scheduling optimizations run, and their knobs); the
    ``Server`` builds the transforms from it (``make_transforms``). The default runs them all;
    ``CoScheduleConfig.none()`` is the plain wavefront scheduler.
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
    cosched: CoScheduleConfig = field(default_factory=CoScheduleConfig)

    def __post_init__(self) -> None:
        if isinstance(self.engine_kwargs, dict):
            object.__setattr__(self, "engine_kwargs", tuple(sorted(self.engine_kwargs.items())))
        if not isinstance(self.cosched, CoScheduleConfig):
            raise TypeError(
                f"cosched must be a CoScheduleConfig, got {type(self.cosched).__name__}"
            )
        for name in ("max_active_requests", "queue_size", "shm_slots", "shm_slot_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
