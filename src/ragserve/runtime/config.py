"""``ServerConfig``: how the runtime runs its workers, built once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    """Runtime knobs. ``in_process`` runs the engine and the index in the server's own process
    (tests, debugging); the default runs each in a persistent worker process.

    ``engine_kwargs`` go to ``LLMEngine`` as keyword arguments (``device``, ``max_num_seqs``,
    ``kv_cache_bytes``, ...). ``default_nprobe`` applies to retrieval nodes with
    ``nprobe=None`` (``None``: the index's own default).

    ``backend="ray"`` runs ``num_llm_replicas`` engines and ``num_index_shards`` index shards
    as Ray actors (``runtime/ray_backend.py``), joining the cluster at ``ray_address`` or
    starting a local one (``ray_num_cpus`` CPUs; ``None``: all of them). ``shard_partition``
    is ``"document"`` (doc-id hash; the default, chosen by measurement: docs/scale_out.md) or
    ``"list"`` (inverted lists balanced by scan cost).
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
    backend: str = "process"
    num_llm_replicas: int = 1
    num_index_shards: int = 1
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    shard_partition: str = "document"

    def __post_init__(self) -> None:
        if isinstance(self.engine_kwargs, dict):
            object.__setattr__(self, "engine_kwargs", tuple(sorted(self.engine_kwargs.items())))
        for name in ("max_active_requests", "queue_size", "shm_slots", "shm_slot_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_backend()

    def _check_backend(self) -> None:
        if self.backend not in ("process", "ray"):
            raise ValueError(f"backend must be 'process' or 'ray', got {self.backend!r}")
        for name in ("num_llm_replicas", "num_index_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.backend == "process" and (self.num_llm_replicas, self.num_index_shards) != (1, 1):
            raise ValueError("num_llm_replicas and num_index_shards > 1 need backend='ray'")
        if self.backend == "ray" and self.in_process:
            raise ValueError("backend='ray' runs actors; it cannot be combined with in_process")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ValueError(f"ray_num_cpus must be >= 1 or None, got {self.ray_num_cpus}")
        if self.shard_partition not in ("list", "document"):
            raise ValueError(
                f"shard_partition must be 'list' or 'document', got {self.shard_partition!r}"
            )
