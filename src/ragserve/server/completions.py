"""``POST /v1/completions``: a plain LLM completion (no retrieval), OpenAI's
``text_completion`` shape, streaming or not. Usage counts come from the engine's tokens."""

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
from ragserve.server.errors import APIError
from ragserve.server.protocol import CompletionRequest

router = APIRouter()

WORKFLOW_LABEL = "completion"  # the `workflow` label of plain completions in /metrics


def sampling_params(body: CompletionRequest) -> Any:
    from ragserve.generation import SamplingParams

    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"invalid sampling parameters: {exc}", code="invalid_request") from exc


def finish_reason(output: Any) -> str | None:
    if not output.finished:
        return None
    return "length" if output.finish_reason == "length" else "stop"


def usage(output: Any) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = get_context(request)
    if body.model not in _known_models(ctx):
        raise APIError(
            404,
            f"model {body.model!r} does not exist; known: {', '.join(_known_models(ctx))}",
            param="model",
            code="model_not_found",
        )
    params = sampling_params(body)
    request_id = new_request_id("cmpl")
    try:
        ctx.admission.try_acquire()
    except Exception:
        ctx.metrics.requests.labels(WORKFLOW_LABEL, "rejected").inc()
        ctx.metrics.rejected.inc()
        raise
    arrival = now()
    if body.stream:
        outcome: dict[str, Any] = {}
        events = _events(ctx, body, params, request_id, arrival, outcome)
        return GuardedStream(events, on_close=lambda: _finish(ctx, request_id, arrival, outcome))
    try:
        return await _answer(ctx, request, body, params, request_id, arrival)
    finally:
        ctx.admission.release()


def _known_models(ctx: AppContext) -> list[str]:
    from ragserve.server.graphs import workflow_model_ids

    return [ctx.config.served_model_name, *workflow_model_ids(ctx.server.workflows)]


async def _last_output(ctx: AppContext, prompt, params, request_id: str, arrival: float):
    last, first = None, True
    async for out in ctx.server.complete(prompt, params, request_id=request_id):
        if first and out.token_ids:
            ctx.metrics.ttft.labels(WORKFLOW_LABEL).observe(now() - arrival)
            first = False
        last = out
    if last is None or not last.finished:
        raise RuntimeError("the engine ended the completion without a finished output")
    return last


async def _answer(ctx: AppContext, request, body, params, request_id, arrival):
    work = _last_output(ctx, body.prompt_input(), params, request_id, arrival)
    try:
        out = await until_disconnect(
            request, work, lambda: ctx.server.abort(request_id), ctx.config.disconnect_poll_s
        )
    except ClientDisconnected:
        ctx.metrics.requests.labels(WORKFLOW_LABEL, "aborted").inc()
        return HTTPResponse(status_code=499)
    except Exception as exc:
        ctx.metrics.requests.labels(WORKFLOW_LABEL, "error").inc()
        raise backend_error(exc) from exc
    _count_ok(ctx, out, arrival)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {"index": 0, "text": out.text, "finish_reason": finish_reason(out), "logprobs": None}
        ],
        "usage": usage(out),
    }


async def _events(ctx: AppContext, body, params, request_id, arrival, outcome):
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    sent, first = "", True
    try:
        async for out in ctx.server.complete(body.prompt_input(), params, request_id=request_id):
            if first and out.token_ids:
                ctx.metrics.ttft.labels(WORKFLOW_LABEL).observe(now() - arrival)
                first = False
            delta = out.text[len(sent) :] if out.text.startswith(sent) else ""
            sent = out.text if delta else sent
            if delta or out.finished:
                choice = {
                    "index": 0,
                    "text": delta,
                    "finish_reason": finish_reason(out),
                    "logprobs": None,
                }
                yield sse({**base, "choices": [choice]})
            if out.finished:
                outcome["final"] = out
    except Exception as exc:
        outcome["status"] = "error"
        yield sse_error(exc)
        yield sse("[DONE]")
        return
    if "final" not in outcome:
        outcome["status"] = "error"
        yield sse_error(RuntimeError("the engine ended the completion without a finished output"))
        yield sse("[DONE]")
        return
    outcome["status"] = "ok"
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse({**base, "choices": [], "usage": usage(outcome["final"])})
    yield sse("[DONE]")


def _count_ok(ctx: AppContext, out, arrival: float) -> None:
    ctx.metrics.requests.labels(WORKFLOW_LABEL, "ok").inc()
    ctx.metrics.e2e.labels(WORKFLOW_LABEL).observe(now() - arrival)
    ctx.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
    ctx.metrics.generation_tokens.inc(len(out.token_ids))


def _finish(ctx: AppContext, request_id: str, arrival: float, outcome: dict) -> None:
    ctx.admission.release()
    status = outcome.get("status", "aborted")
    if status == "ok":
        _count_ok(ctx, outcome["final"], arrival)
        return
    if status == "aborted":
        ctx.server.abort(request_id)
    ctx.metrics.requests.labels(WORKFLOW_LABEL, status).inc()
