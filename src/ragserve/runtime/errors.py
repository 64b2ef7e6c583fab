"""``WorkerError``: a call into a worker that failed for a reason the caller can act on.

``kind`` follows the scheduler's ``ErrorKind`` vocabulary where it overlaps, so the HTTP
front maps it to a status without knowing the runtime: ``"worker_died"`` (503, retry),
``"timeout"`` (503: no answer within ``ServerConfig.call_timeout_s``), ``"overloaded"``
(429: too many calls in flight), ``"bad_request"`` (400: e.g. arguments that cannot be sent
to a worker), ``"internal"`` (500).
"""

from __future__ import annotations

from ragserve.scheduler import GenerationUpdate


class WorkerError(RuntimeError):
    def __init__(self, message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.kind = kind


def error_kind_of(exc: BaseException) -> str:
    """``"bad_request"`` for failures a request's own input causes (bad values, text a
    tokenizer cannot encode), else ``"internal"``."""
    return "bad_request" if isinstance(exc, (ValueError, TypeError)) else "internal"


def failure(exc: BaseException) -> tuple[str, str]:
    """``(message, kind)`` for a task ``exc`` failed: a bad request's own message; for anything
    else only the exception's type (the details go to the worker's log, not to the client)."""
    kind = error_kind_of(exc)
    return (str(exc) if kind == "bad_request" else f"{type(exc).__name__} in the worker"), kind


def failed_update(task_id: str, reason: str, kind: str = "internal") -> GenerationUpdate:
    """The final ``GenerationUpdate`` of a generation task that failed."""
    return GenerationUpdate(task_id, "", (), True, "error", error=reason, error_kind=kind)
