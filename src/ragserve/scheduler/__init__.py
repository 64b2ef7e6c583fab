"""The scheduler: request state, the per-cycle wavefront, transforms, and the executor contract.

It never does model math: generation and retrieval run behind a ``BaseExecutor`` (in process
for tests, worker processes in ``ragserve.runtime``).
"""

from ragserve.scheduler.executor import BaseExecutor, Update
from ragserve.scheduler.messages import (
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
    Wavefront,
)
from ragserve.scheduler.request import NodeTiming, RequestState, Response
from ragserve.scheduler.scheduler import Scheduler
from ragserve.scheduler.transforms import BaseTransform

__all__ = [
    "BaseExecutor",
    "BaseTransform",
    "GenerationParams",
    "GenerationTask",
    "GenerationUpdate",
    "NodeTiming",
    "RequestState",
    "Response",
    "RetrievalResult",
    "RetrievalTask",
    "Scheduler",
    "Update",
    "Wavefront",
]
