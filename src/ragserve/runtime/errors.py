"""``WorkerError``: a call into a worker that failed for a reason the caller can act on.

``kind`` follows the scheduler's ``ErrorKind`` vocabulary where it overlaps, so the HTTP
front maps it to a status without knowing the runtime: ``"worker_died"`` (503, retry),
``"timeout"`` (503: no answer within ``ServerConfig.call_timeout_s``), ``"overloaded"``
(429: too many calls in flight), ``"bad_request"`` (400: e.g. arguments that cannot be sent
to a worker), ``"internal"`` (500).
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    def __init__(self, message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.kind = kind


def error_kind_of(exc: BaseException) -> str:
    """``"bad_request"`` for failures a request's own input causes (bad values, text a
    tokenizer cannot encode), else ``"internal"``."""
    return "bad_request" if isinstance(exc, (ValueError, TypeError)) else "internal"
