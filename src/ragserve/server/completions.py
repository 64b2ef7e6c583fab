"""``POST /v1/completions``: a plain LLM completion (no retrieval), OpenAI's
``text_completion`` shape, streaming or not. Usage counts come from the engine's tokens."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server.context import (
    GuardedStream,
    Job,
    get_context,
    sse,
    sse_error,
)
from ragserve.server.errors import APIError
from ragserve.server.graphs import workflow_model_ids
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
    known = [ctx.config.served_model_name, *workflow_model_ids(ctx.server.workflows)]
    if body.model not in known:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; known: {', '.join(known)}",
            param="model",
            code="model_not_found",
        )
    params = sampling_params(body)
    job = Job.admit(ctx, "cmpl", WORKFLOW_LABEL, body.model)
    if body.stream:
        final: dict[str, Any] = {}
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(job, body.prompt_input(), params, include_usage, final)
        return GuardedStream(events, on_close=lambda: _end_stream(job, final))
    out = await job.wait(
        request,
        _last_output(job, body.prompt_input(), params),
        check=lambda out: _count_tokens(job, out),
    )
    if out is None:
        return HTTPResponse(status_code=499)
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {"index": 0, "text": out.text, "finish_reason": finish_reason(out), "logprobs": None}
        ],
        "usage": usage(out),
    }


async def _outputs(job: Job, prompt: str | list[int], params: Any):
    """The engine's cumulative outputs (the first token timed); fails unless the last one is
    finished."""
    last = None
    async for out in job.ctx.server.complete(prompt, params, request_id=job.request_id):
        if (last is None or not last.token_ids) and out.token_ids:
            job.first_token()
        last = out
        yield out
    if last is None or not last.finished:
        raise RuntimeError("the engine ended the completion without a finished output")


async def _last_output(job: Job, prompt: str | list[int], params: Any) -> Any:
    async for out in _outputs(job, prompt, params):
        last = out
    return last


async def _events(job: Job, prompt, params, include_usage: bool, final: dict[str, Any]):
    """SSE events of one streamed completion; ``final["end"]`` is set when it ends by itself
    (and ``final["output"]`` holds the last ``RequestOutput`` on success)."""
    base = {
        "id": job.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": job.model,
    }
    sent, last = "", None
    try:
        async for out in _outputs(job, prompt, params):
            last = out
            delta = out.text[len(sent) :] if out.text.startswith(sent) else ""
            sent += delta
            if delta or out.finished:
                choice = {
                    "index": 0,
                    "text": delta,
                    "finish_reason": finish_reason(out),
                    "logprobs": None,
                }
                yield sse({**base, "choices": [choice]})
    except Exception as exc:
        final["end"] = "error"
        yield sse_error(exc, job.request_id)
        yield sse("[DONE]")
        return
    final["end"], final["output"] = "ok", last
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(last)})
    yield sse("[DONE]")


def _count_tokens(job: Job, out: Any) -> None:
    metrics = job.ctx.metrics
    metrics.prompt_tokens.labels(job.model).inc(len(out.prompt_token_ids))
    metrics.generation_tokens.labels(job.model).inc(len(out.token_ids))
    timing = getattr(out, "metrics", None)
    first, last = getattr(timing, "first_token_time", None), getattr(timing, "finish_time", None)
    if first is not None and last is not None:
        metrics.observe_itl(job.model, last - first, len(out.token_ids))


def _end_stream(job: Job, final: dict[str, Any]) -> None:
    if "output" in final:
        _count_tokens(job, final["output"])
    job.end(final.get("end", "aborted"))
