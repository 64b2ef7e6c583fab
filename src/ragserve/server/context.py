"""What every handler shares (``AppContext``) and the two ways a request can end early:
the client disconnects (abort it, free its KV blocks) or the backend raises."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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
    server: ServerBackend
    config: ServeConfig
    metrics: ServerMetrics
    admission: Admission


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


# NOTE: the runtime reports a request's failure as a string (``Response.error``), so the
# engine's bad-input rejections (``PromptTooLongError`` and other ``ValueError``s of
# ``add_request``) are recognised by their messages to answer 400 rather than 500.
BAD_INPUT_MARKERS = ("but the context holds", ": empty prompt", ": token id outside")


def backend_error(exc: BaseException) -> APIError:
    """A backend failure as an HTTP error: bad input (``ValueError``) is 400, the rest 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError) or any(m in str(exc) for m in BAD_INPUT_MARKERS):
        return APIError(400, str(exc), code="invalid_request")
    logger.error("request failed in the backend: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    err = backend_error(exc)
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
