"""What every handler shares: the backend's contract, the app's context, admission, and the
life of one generation request (``Job``) until it ends, also early: the client disconnects
(abort it, free its KV blocks) or the backend raises."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ragserve.server.config import ServeConfig
from ragserve.server.errors import APIError, backend_error, error_body, new_request_id
from ragserve.server.metrics import ServerMetrics

T = TypeVar("T")


class ServerBackend(Protocol):
    """What the front needs of ``ragserve.runtime.Server`` (its public contract).

    ``stream`` yields text deltas of the answer and hands the final ``Response`` to
    ``on_response`` before it ends; ``complete`` yields cumulative ``RequestOutput``s of a
    plain LLM completion; ``abort`` frees the request's KV blocks. ``add_documents`` /
    ``delete_documents`` return once persisted; their failures carry a ``kind``. ``embed``
    (optional: ``/v1/embeddings`` is a 404 without it) returns ``Embeddings``; ``health()`` is
    ``{"status": "ok" | "unhealthy", "problems": [...]}``.
    """

    workflows: Mapping[str, Any]

    async def submit(
        self, question: str, graph: Any, *, request_id: str | None = None, history=()
    ) -> Any: ...
    def stream(
        self, question: str, graph: Any, *, request_id=None, on_response=None, history=()
    ) -> AsyncIterator[str]: ...
    def complete(self, prompt: str, params: Any, *, request_id=None) -> AsyncIterator[Any]: ...
    def abort(self, request_id: str) -> None: ...
    def add_documents(self, docs: Sequence[Any]) -> Any: ...
    def delete_documents(self, doc_ids: Sequence[str]) -> Any: ...
    def stats(self) -> Mapping[str, Any]: ...
    def health(self) -> Mapping[str, Any]: ...
    def close(self) -> None: ...


class Admission:
    """A non-blocking count of admitted requests (one event loop, so no lock): at most
    ``limit`` in flight, the rest get 429 with ``Retry-After``."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.num_inflight = 0
        self.num_rejected = 0

    def try_acquire(self) -> None:
        if self.num_inflight >= self.limit:
            self.num_rejected += 1
            raise APIError(
                429,
                f"server is at its admission limit of {self.limit} concurrent requests; "
                f"retry after {self.retry_after_s} s",
                code="too_many_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.num_inflight += 1

    def release(self) -> None:
        assert self.num_inflight > 0, "release() without a matching try_acquire()"
        self.num_inflight -= 1

    @contextmanager
    def admit(self) -> Iterator[None]:
        self.try_acquire()
        try:
            yield
        finally:
            self.release()


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


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def choice(**fields: Any) -> dict:
    """One OpenAI choice (we give one per request)."""
    return {"index": 0, **fields, "logprobs": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Job:
    """One admitted generation request (chat or completion) until ``end()``.

    ``label`` is the ``workflow`` label in /metrics; ``model`` is echoed in responses;
    ``status`` is how it ends unless told (``"aborted"``: the client went away, until a
    stream sets ``"ok"``). ``end()`` runs once: it releases the admission slot, aborts the
    request in the Server unless it finished, counts it.
    """

    ctx: AppContext
    request_id: str
    label: str
    model: str
    arrival: float
    status: str = "aborted"
    ended: bool = False
    first_token_seen: bool = False

    @classmethod
    def admit(cls, ctx: AppContext, prefix: str, label: str, model: str) -> Job:
        """Take an admission slot or raise 429 (counted as ``rejected``)."""
        try:
            ctx.admission.try_acquire()
        except APIError:
            ctx.metrics.requests.labels(label, "rejected").inc()
            ctx.metrics.rejected.inc()
            raise
        return cls(ctx, new_request_id(prefix), label, model, time.monotonic())

    def first_token(self) -> None:
        """The answer's first token arrived (its time to first token observed once)."""
        if not self.first_token_seen:
            self.first_token_seen = True
            self.ctx.metrics.ttft.labels(self.label).observe(time.monotonic() - self.arrival)

    def end(self, status: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        status = status or self.status
        self.ctx.admission.release()
        if status == "aborted":
            self.ctx.server.abort(self.request_id)
        elif status == "ok":
            self.ctx.metrics.e2e.labels(self.label).observe(time.monotonic() - self.arrival)
        self.ctx.metrics.requests.labels(self.label, status).inc()

    async def wait(
        self, request: Request, work: Awaitable[T], check: Callable[[T], None] | None = None
    ) -> T | None:
        """Await ``work`` (a non-streamed answer), then end the job: ``None`` if the client
        disconnected first; ``check`` may raise on a result that is an error; any failure is
        raised as an ``APIError``."""
        status = "error"
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=self.ctx.config.disconnect_poll_s))[0]:
                if await request.is_disconnected():
                    status = "aborted"
                    return None
            result = task.result()
            if check is not None:
                check(result)
            status = "ok"
            return result
        except Exception as exc:
            raise backend_error(exc, self.request_id) from exc
        finally:
            if not task.done():
                task.cancel()
            self.end(status)

    def head(self, obj: str) -> dict:
        """The fields every response body and stream chunk starts with."""
        return {
            "id": self.request_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
        }

    def stream(self, obj: str, chunks: AsyncIterator[dict]) -> GuardedStream:
        """SSE of ``chunks`` (each under the id/object/created/model header), then ``[DONE]``;
        a failure is one error event. The job ends when the response closes."""
        head = self.head(obj)

        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield sse({**head, **chunk})
            except Exception as exc:
                self.status = "error"
                err = backend_error(exc, self.request_id)
                yield sse(error_body(err.status_code, err.message, code=err.code))
            yield sse("[DONE]")

        return GuardedStream(events(), on_close=self.end)


async def call_backend(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking Server method (``embed``, ``add_documents``, ``delete_documents``) on a
    thread, its failure as an HTTP error."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as exc:
        raise backend_error(exc) from exc


class GuardedStream(StreamingResponse):
    """An SSE response that runs ``on_close`` exactly once however it ends (finished,
    client gone, cancelled by shutdown, or never started)."""

    def __init__(self, content, on_close: Callable[[], Any]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()
