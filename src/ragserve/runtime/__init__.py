"""The runtime: ``Server``, persistent generation/retrieval worker processes, bounded queues
and the shared-memory data plane."""

from ragserve.runtime.config import GpuTierConfig, ServerConfig
from ragserve.runtime.errors import WorkerError
from ragserve.runtime.server import Server
from ragserve.runtime.worker_start import MainGuardError
from ragserve.scheduler.cosched import CoScheduleConfig
from ragserve.scheduler.operators import OperatorConfig
from ragserve.scheduler.request import ErrorKind, NodeTiming, RequestError, Response

__all__ = [
    "CoScheduleConfig",
    "ErrorKind",
    "GpuTierConfig",
    "MainGuardError",
    "NodeTiming",
    "OperatorConfig",
    "RequestError",
    "Response",
    "Server",
    "ServerConfig",
    "WorkerError",
]
