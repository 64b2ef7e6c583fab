"""``POST /v1/chat/completions``: a RAG workflow answers the last user message.

The ``model`` field (or the ``workflow`` extension) picks the workflow; the answer comes back
in OpenAI's ``chat.completion`` shape (or ``chat.completion.chunk`` SSE events ending in
``[DONE]``), with the retrieved documents in the extension field ``documents``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server.context import (
    AppContext,
    ClientDisconnected,
    GuardedStream,
    backend_error,
    get_context,
    new_request_id,
    now,
    sse,
    sse_error,
    until_disconnect,
)
from ragserve.server.graphs import resolve_workflow, retrieval_node_ids, tune_graph
from ragserve.server.protocol import ChatCompletionRequest

router = APIRouter()


def documents_of(response: Any) -> list[dict]:
    titles = list(response.titles or ())
    titles += [None] * (len(response.doc_ids) - len(titles))
    return [{"id": d, "title": t} for d, t in zip(response.doc_ids, titles, strict=False)]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = get_context(request)
    name, graph = resolve_workflow(ctx.server.workflows, body.model, body.workflow)
    graph = tune_graph(
        graph,
        topk=body.topk,
        nprobe=body.nprobe,
        max_tokens=body.token_limit(),
        temperature=body.temperature,
        stop=body.stop_strings(),
    )
    request_id = new_request_id("chatcmpl")
    try:
        ctx.admission.try_acquire()
    except Exception:
        ctx.metrics.requests.labels(name, "rejected").inc()
        ctx.metrics.rejected.inc()
        raise
    arrival = now()
    if body.stream:
        outcome: dict[str, str] = {}
        events = _events(ctx, body, name, graph, request_id, arrival, outcome)
        return GuardedStream(
            events, on_close=lambda: _finish(ctx, name, request_id, arrival, outcome)
        )
    try:
        return await _answer(ctx, request, body, name, graph, request_id, arrival)
    finally:
        ctx.admission.release()


async def _answer(ctx: AppContext, request, body, name, graph, request_id, arrival):
    server = ctx.server
    work = server.submit(body.question(), graph, request_id=request_id)
    try:
        response = await until_disconnect(
            request, work, lambda: server.abort(request_id), ctx.config.disconnect_poll_s
        )
    except ClientDisconnected:
        ctx.metrics.requests.labels(name, "aborted").inc()
        return HTTPResponse(status_code=499)
    except Exception as exc:
        ctx.metrics.requests.labels(name, "error").inc()
        raise backend_error(exc) from exc
    if response.error is not None:
        ctx.metrics.requests.labels(name, "error").inc()
        err = response.error
        raise backend_error(err if isinstance(err, BaseException) else RuntimeError(str(err)))
    ctx.metrics.requests.labels(name, "ok").inc()
    ctx.metrics.e2e.labels(name).observe(now() - arrival)
    _observe_timings(ctx, name, graph, response)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": response.output},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "workflow": name,
        "documents": documents_of(response),
    }


async def _events(ctx: AppContext, body, name, graph, request_id, arrival, outcome):
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
    }

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return sse({**base, "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    first = True
    try:
        async for delta in ctx.server.stream(body.question(), graph, request_id=request_id):
            if not delta:
                continue
            if first:
                ctx.metrics.ttft.labels(name).observe(now() - arrival)
                first = False
            yield chunk({"content": delta})
    except Exception as exc:
        outcome["status"] = "error"
        yield sse_error(exc)
        yield sse("[DONE]")
        return
    outcome["status"] = "ok"
    yield chunk({}, "stop", workflow=name)
    yield sse("[DONE]")


def _finish(ctx: AppContext, name: str, request_id: str, arrival: float, outcome: dict) -> None:
    ctx.admission.release()
    status = outcome.get("status", "aborted")
    if status == "aborted":
        ctx.server.abort(request_id)
    elif status == "ok":
        ctx.metrics.e2e.labels(name).observe(now() - arrival)
    ctx.metrics.requests.labels(name, status).inc()


def _observe_timings(ctx: AppContext, name: str, graph, response) -> None:
    """TTFT and per-run retrieval latency from ``Response.node_timings`` when the runtime
    gives them, else retrieval latency from the per-node ``timings`` of the contract."""
    ttft = getattr(response, "ttft", None)
    if ttft is not None:
        ctx.metrics.ttft.labels(name).observe(ttft)
    runs = getattr(response, "node_timings", None)
    if runs:
        seconds = [t.duration for t in runs if t.kind == "retrieval" and t.duration is not None]
    else:
        timings = response.timings or {}
        seconds = [timings[n] for n in retrieval_node_ids(graph) if n in timings]
    for value in seconds:
        ctx.metrics.retrieval.labels(name).observe(float(value))
