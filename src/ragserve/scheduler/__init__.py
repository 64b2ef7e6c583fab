"""The scheduler: request state, the per-cycle wavefront, transforms, and the executor contract
(generation and retrieval run behind a ``BaseExecutor``: no model math here)."""

from ragserve.scheduler.messages import (
    BaseExecutor,
    EmbedTask,
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    OperatorResult,
    RerankTask,
    RetrievalResult,
    RetrievalTask,
    Update,
    UpsertTask,
    Wavefront,
)
from ragserve.scheduler.operators import MemoryStore, OperatorConfig
from ragserve.scheduler.request import NodeTiming, RequestState, Response
from ragserve.scheduler.scheduler import Scheduler
from ragserve.scheduler.transforms import BaseTransform, NextStep, SchedulerView, TaskView

__all__ = [
    "BaseExecutor",
    "BaseTransform",
    "EmbedTask",
    "GenerationParams",
    "GenerationTask",
    "GenerationUpdate",
    "MemoryStore",
    "NextStep",
    "NodeTiming",
    "OperatorConfig",
    "OperatorResult",
    "RequestState",
    "RerankTask",
    "Response",
    "RetrievalResult",
    "RetrievalTask",
    "Scheduler",
    "SchedulerView",
    "TaskView",
    "Update",
    "UpsertTask",
    "Wavefront",
]
