"""``POST /v1/completions``: a plain LLM completion (no retrieval), OpenAI's
``text_completion`` shape, streaming or not. Usage counts come from the engine's tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server.context import Job, choice, get_context, usage
from ragserve.server.errors import APIError, model_not_found
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


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = get_context(request)
    known = [ctx.config.served_model_name, *workflow_model_ids(ctx.server.workflows)]
    if body.model not in known:
        raise model_not_found(f"model {body.model!r} does not exist; known: {', '.join(known)}")
    params = sampling_params(body)
    job = Job.admit(ctx, "cmpl", WORKFLOW_LABEL, body.model)
    outputs = _outputs(job, body.prompt_input(), params)
    if body.stream:
        return job.stream("text_completion", _chunks(job, outputs, body.include_usage()))
    out = await job.wait(request, _last(outputs))
    if out is None:
        return HTTPResponse(status_code=499)
    return {
        **job.head("text_completion"),
        "choices": [choice(text=out.text, finish_reason=finish_reason(out))],
        "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
    }


async def _outputs(job: Job, prompt: str | list[int], params: Any):
    """The engine's cumulative outputs (the first token timed, the tokens counted at the end);
    fails unless the last one is finished."""
    last = None
    async for out in job.ctx.server.complete(prompt, params, request_id=job.request_id):
        if out.token_ids:
            job.first_token()
        last = out
        yield out
    if last is None or not last.finished:
        raise RuntimeError("the engine ended the completion without a finished output")
    metrics, timing = job.ctx.metrics, getattr(last, "metrics", None)
    metrics.count_tokens(job.model, len(last.prompt_token_ids), len(last.token_ids))
    first, end = getattr(timing, "first_token_time", None), getattr(timing, "finish_time", None)
    metrics.observe_itl(job.model, first, end, len(last.token_ids))


async def _last(outputs) -> Any:
    async for out in outputs:
        last = out
    return last


async def _chunks(job: Job, outputs, include_usage: bool):
    sent = ""
    async for out in outputs:
        delta = out.text[len(sent) :] if out.text.startswith(sent) else ""
        sent += delta
        if delta or out.finished:
            yield {"choices": [choice(text=delta, finish_reason=finish_reason(out))]}
    job.status = "ok"
    if include_usage:
        yield {"choices": [], "usage": usage(len(out.prompt_token_ids), len(out.token_ids))}
