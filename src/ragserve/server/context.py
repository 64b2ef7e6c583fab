"""What every handler shares (``AppContext``) and the two ways a request can end early:
the client disconnects (abort it, free its KV blocks) or the backend raises."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ragserve.server.admission import Admission
from ragserve.server.backend import ServerBackend
from ragserve.server.config import ServeConfig
from ragserve.server.errors import APIError, error_body
from ragserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class AppContext:
    """What the handlers share; ``cache`` holds what is looked up once (the embedder's name,
    the tokenizer)."""

    server: ServerBackend
    config: ServeConfig
    metrics: ServerMetrics
    admission: Admission
    cache: dict[str, Any] = field(default_factory=dict)


def get_context(request: Request) -> AppContext:
    return request.app.state.ctx


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> float:
    return time.monotonic()


@dataclass
class Job:
    """One admitted generation request (chat or completion) until ``end()``.

    ``label`` is the ``workflow`` label in /metrics (a workflow name, or ``"completion"``);
    ``model`` is echoed back in responses. ``end(status)`` runs exactly once: it releases the
    admission slot, aborts the request in the Server unless it finished, counts it.
    """

    ctx: AppContext
    request_id: str
    label: str
    model: str
    arrival: float
    ended: bool = False

    @classmethod
    def admit(cls, ctx: AppContext, prefix: str, label: str, model: str) -> Job:
        """Take an admission slot or raise 429 (counted as ``rejected``)."""
        try:
            ctx.admission.try_acquire()
        except APIError:
            ctx.metrics.requests.labels(label, "rejected").inc()
            ctx.metrics.rejected.inc()
            raise
        return cls(ctx, new_request_id(prefix), label, model, now())

    def first_token(self) -> None:
        self.ctx.metrics.ttft.labels(self.label).observe(now() - self.arrival)

    def end(self, status: str) -> None:
        """``status``: ``"ok"``, ``"error"`` or ``"aborted"`` (the client went away)."""
        if self.ended:
            return
        self.ended = True
        self.ctx.admission.release()
        if status == "aborted":
            self.ctx.server.abort(self.request_id)
        elif status == "ok":
            self.ctx.metrics.e2e.labels(self.label).observe(now() - self.arrival)
        self.ctx.metrics.requests.labels(self.label, status).inc()

    async def wait(
        self, request: Request, work: Awaitable[T], check: Callable[[T], None] | None = None
    ) -> T | None:
        """Await ``work`` (a non-streamed answer), then end the job.

        ``None`` if the client disconnected first (the job ends ``"aborted"``); ``check`` may
        raise on a result that is an error; any failure is raised as an ``APIError``.
        """
        status = "error"
        try:
            result = await until_disconnect(request, work, self.ctx.config.disconnect_poll_s)
            if check is not None:
                check(result)
            status = "ok"
            return result
        except ClientDisconnected:
            status = "aborted"
            return None
        except Exception as exc:
            raise backend_error(exc, self.request_id) from exc
        finally:
            self.end(status)


async def call_backend(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a (possibly blocking, possibly async) Server method without blocking the loop."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)
    except Exception as exc:
        raise backend_error(exc) from exc


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; the request was aborted."""


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected`` (the caller's ``Job.end("aborted")`` aborts it in the Server)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


# ``Response.error_kind`` (or ``RequestError.kind``) -> (HTTP status, error code)
KIND_STATUS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request"),
    "overloaded": (429, "too_many_requests"),
    "worker_died": (503, "worker_died"),
    "timeout": (503, "worker_timeout"),
    "aborted": (499, "aborted"),
    "internal": (500, "internal_error"),
}
# Kinds whose message is the runtime's own sentence (no exception text): sent as is.
_PUBLIC_KINDS = frozenset({"bad_request", "overloaded", "worker_died", "timeout", "aborted"})


def error_for_kind(kind: str | None, message: str, request_id: str | None = None) -> APIError:
    """The HTTP error for a failed request of ``kind`` (an ``ErrorKind``; unknown: 500).

    An internal error's message stays in the server log under the request id; the client gets
    the id, never the exception text."""
    kind = kind if kind in KIND_STATUS else "internal"
    status, code = KIND_STATUS[kind]
    if status >= 500:
        request_id = request_id or new_request_id("error")
        logger.error("request %s failed in the backend (%s): %s", request_id, kind, message)
        if kind not in _PUBLIC_KINDS:
            message = f"internal error (request id {request_id}); details are in the server log"
    return APIError(status, message, code=code)


def response_error(response: Any) -> APIError:
    """The HTTP error of a ``Response`` whose ``error`` is set, by its ``error_kind``."""
    kind = getattr(response, "error_kind", None)
    return error_for_kind(kind, str(response.error), getattr(response, "request_id", None))


def backend_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """A backend failure as an HTTP error: by the exception's ``kind`` (``RequestError``),
    else a ``ValueError`` is 400 (bad input) and anything else 500."""
    if isinstance(exc, APIError):
        return exc
    kind = getattr(exc, "kind", None)
    if kind in KIND_STATUS:
        return error_for_kind(kind, str(exc), request_id)
    if isinstance(exc, ValueError):
        return error_for_kind("bad_request", str(exc), request_id)
    return error_for_kind("internal", f"{type(exc).__name__}: {exc}", request_id)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(exc: BaseException, request_id: str | None = None) -> str:
    err = backend_error(exc, request_id)
    return sse(error_body(err.status_code, err.message, code=err.code))


class GuardedStream(StreamingResponse):
    """An SSE response that runs ``on_close`` exactly once however it ends (finished,
    client gone, cancelled by shutdown, or never started)."""

    def __init__(self, content, on_close: Callable[[], Any]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()
