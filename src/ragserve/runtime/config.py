"""``ServerConfig``: how the runtime runs its workers, built once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragserve.retrieval.limits import DocumentLimits
from ragserve.runtime.worker_start import START_METHODS
from ragserve.scheduler.cosched import CoScheduleConfig
from ragserve.scheduler.operators import OperatorConfig

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

# ``retrieval.gpu_tier.SCANS`` (no torch import here)
TIER_SCANS = ("auto", "grouped", "dense", "fused")
STREAM_MODES = ("auto", "on", "off")  # ``retrieval.cold_stream.STREAM_MODES``
COUNTS = (  # the ``ServerConfig`` fields that must be >= 1
    "max_active_requests",
    "queue_size",
    "max_pending_messages",
    "shm_slots",
    "shm_slot_bytes",
    "max_message_bytes",
    "max_num_calls",
    "num_llm_replicas",
    "num_index_shards",
)


@dataclass(frozen=True)
class GpuTierConfig:
    """The retrieval worker's GPU index tier (``VectorIndex.set_gpu_tier``). ``budget_bytes``
    fixes its size; ``None`` lets HedraRAG's Eq. 2 split ``gpu_memory_bytes`` (``None``:
    measured on ``device`` minus the weights) between it and the KV cache from the measured
    ``generation_profile`` ``((kv_blocks, rps), ...)`` and ``retrieval_profile`` ``((bytes,
    rps), ...)`` (``memory_plan``). ``scan``, ``stream_cold`` and ``stream_host_bytes``:
    ``retrieval.gpu_tier`` / ``retrieval.cold_stream``."""

    budget_bytes: int | None = None
    device: str = "cuda"
    dtype: str = "float32"
    gpu_memory_bytes: int | None = None
    generation_profile: tuple[tuple[float, float], ...] | None = None
    retrieval_profile: tuple[tuple[float, float], ...] | None = None
    scan: str = "auto"
    stream_cold: str = "auto"
    stream_host_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        at_least(0, budget_bytes=self.budget_bytes)
        at_least(
            1, gpu_memory_bytes=self.gpu_memory_bytes, stream_host_bytes=self.stream_host_bytes
        )
        _one_of(self, "dtype", ("float32", "float16", "bfloat16"))
        _one_of(self, "scan", TIER_SCANS)
        _one_of(self, "stream_cold", STREAM_MODES)

    def tier_spec(self, budget_bytes: int) -> TierSpec:
        from ragserve.retrieval.index_tier import TierSpec

        return TierSpec(
            int(budget_bytes),
            self.device,
            self.dtype,
            self.scan,
            self.stream_cold,
            self.stream_host_bytes,
        )


@dataclass(frozen=True)
class ServerConfig:
    """Runtime knobs, each described in docs/architecture.md ("Server", "Data plane",
    "Scale-out on Ray"). ``in_process`` runs the engine and the index in the server's process
    (tests, debugging), the default in persistent worker processes (``worker_start_method``);
    ``backend="ray"`` runs them as Ray actors. Every wait on a worker is bounded
    (``call_timeout_s``, ``max_num_calls``, ``max_active_requests``, ``queue_size``,
    ``max_pending_messages``; past them: ``WorkerError`` or tasks failed as ``overloaded``).
    ``cosched`` is data: the ``Server`` builds the transforms from it."""

    in_process: bool = False
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    default_nprobe: int | None = None
    max_active_requests: int = 256
    queue_size: int = 64
    max_pending_messages: int = 256
    shm_slots: int = 8
    shm_slot_bytes: int = 8 << 20
    max_message_bytes: int = 1 << 28
    small_message_bytes: int = 1 << 20  # smaller results ride pickled (``wire.py``; BENCHMARKS.md)
    tokenizer_prefetch: bool = True
    worker_start_timeout: float = 600.0
    max_node_runs: int = 256
    poll_timeout: float = 0.02
    busy_poll_timeout: float | None = 0.5
    enable_update_coalescing: bool = True
    cosched: CoScheduleConfig = field(default_factory=CoScheduleConfig)
    gpu_tier: GpuTierConfig | None = None
    call_timeout_s: float = 600.0
    max_num_calls: int = 16
    document_limits: DocumentLimits = field(default_factory=DocumentLimits)
    health_stall_s: float = 10.0
    backend: str = "process"
    num_llm_replicas: int = 1
    num_index_shards: int = 1
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    shard_partition: str = "document"
    operators: OperatorConfig = field(default_factory=OperatorConfig)
    worker_start_method: str = "forkserver"

    def __post_init__(self) -> None:
        if isinstance(self.engine_kwargs, dict):
            object.__setattr__(self, "engine_kwargs", tuple(sorted(self.engine_kwargs.items())))
        if not isinstance(self.cosched, CoScheduleConfig):
            raise TypeError(
                f"cosched must be a CoScheduleConfig, got {type(self.cosched).__name__}"
            )
        if self.busy_poll_timeout is not None and not 0 < self.busy_poll_timeout < float("inf"):
            raise ValueError(
                f"busy_poll_timeout must be a positive number or None, got {self.busy_poll_timeout}"
            )
        for name in ("call_timeout_s", "health_stall_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        at_least(1, ray_num_cpus=self.ray_num_cpus, **{n: getattr(self, n) for n in COUNTS})
        if not 0 <= self.small_message_bytes <= self.max_message_bytes:
            raise ValueError(
                f"small_message_bytes must be in [0, max_message_bytes], "
                f"got {self.small_message_bytes}"
            )
        _one_of(self, "backend", ("process", "ray"))
        _one_of(self, "worker_start_method", START_METHODS)
        _one_of(self, "shard_partition", ("list", "document"))
        if self.backend == "process" and (self.num_llm_replicas, self.num_index_shards) != (1, 1):
            raise ValueError("num_llm_replicas and num_index_shards > 1 need backend='ray'")
        if self.backend == "ray" and self.in_process:
            raise ValueError("backend='ray' runs actors; it cannot be combined with in_process")
        if self.backend == "ray" and self.gpu_tier and self.gpu_tier.budget_bytes is None:
            raise ValueError(
                "gpu_tier.budget_bytes: backend='ray' needs an explicit tier size (split "
                "evenly over the index shards; the Eq. 2 split is not run for actors)"
            )


def at_least(minimum: int, **values: int | None) -> None:
    """``ValueError`` naming the first of ``values`` below ``minimum`` (``None`` is no value)."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _one_of(config: Any, name: str, choices: tuple[str, ...]) -> None:
    if getattr(config, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(config, name)!r}")
