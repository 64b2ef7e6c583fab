"""``POST /v1/chat/completions``: a RAG workflow (``model``, or the ``workflow`` extension)
answers the last user message, or the LLM itself (the served model name) chats, no retrieval.
Earlier messages reach the answer node through the chat template. Extensions: ``documents``
(of the response, or of the stream's last chunk), ``usage_by_node``, ``workflow``, ``inputs``
(``graphs.request_inputs_or_400``); the README's HTTP section has the field list."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server.context import (
    GuardedStream,
    Job,
    get_context,
    response_error,
    sse,
    sse_error,
)
from ragserve.server.graphs import (
    LLM_LABEL,
    request_inputs_or_400,
    resolve_workflow,
    retrieval_node_ids,
    tune_graph_or_400,
)
from ragserve.server.protocol import ChatCompletionRequest

router = APIRouter()


def _raise_if_failed(response: Any) -> None:
    if response.error is not None:
        raise response_error(response)


def documents_of(response: Any) -> list[dict]:
    """``[{"id", "title"}]`` of the retrieved documents, with ``text`` and ``score`` added when
    the final state still holds the passage (``state["docs"]`` of the built-in workflows)."""
    passages: dict[str, Any] = {}
    for value in (response.state or {}).values():
        if isinstance(value, (list, tuple)):
            for item in value:
                if getattr(item, "doc_id", None) is not None:
                    passages.setdefault(item.doc_id, item)
    titles = list(response.titles or ())
    titles += [None] * (len(response.doc_ids) - len(titles))
    docs = []
    for doc_id, title in zip(response.doc_ids, titles, strict=False):
        doc = {"id": doc_id, "title": title}
        passage = passages.get(doc_id)
        if passage is not None:
            doc.update(text=passage.text, score=getattr(passage, "score", None))
        docs.append(doc)
    return docs


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = get_context(request)
    llm_id = ctx.config.served_model_name
    name, graph = resolve_workflow(ctx.server.workflows, body.model, body.workflow, llm_id)
    is_llm = name == LLM_LABEL and body.workflow is None and body.model == llm_id
    temperature = body.temperature
    if is_llm and temperature is None:
        temperature = 1.0  # OpenAI's default, as /v1/completions
    graph = tune_graph_or_400(
        graph,
        topk=body.topk,
        nprobe=body.nprobe,
        mode=body.mode,
        filter=body.filter,
        max_tokens=body.token_limit() or (ctx.config.default_max_tokens if is_llm else None),
        temperature=temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
    )
    # NOTE: ``history`` only when there is one, so a single-turn chat is the same call (and
    # the same state, prompts and outputs) as before conversations were passed on.
    extra: dict[str, Any] = {"history": history} if (history := body.history()) else {}
    if inputs := request_inputs_or_400(name, graph, body.inputs):
        extra["inputs"] = inputs
    job = Job.admit(ctx, "chatcmpl", name, body.model)
    if body.stream:
        status: dict[str, str] = {}
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(job, body.question(), graph, status, include_usage, extra)
        return GuardedStream(events, on_close=lambda: job.end(status.get("end", "aborted")))
    response = await job.wait(
        request,
        ctx.server.submit(body.question(), graph, request_id=job.request_id, **extra),
        check=_raise_if_failed,
    )
    if response is None:
        return HTTPResponse(status_code=499)
    _observe_timings(job, graph, response)
    _count_tokens(job, response)
    return {
        "id": job.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": response.output},
                "finish_reason": finish_reason_of(response),
                "logprobs": None,
            }
        ],
        "usage": usage_of(response),
        "usage_by_node": usage_by_node(response),
        "workflow": name,
        "documents": documents_of(response),
    }


def _generation_runs(response: Any) -> list[Any]:
    return [t for t in getattr(response, "node_timings", ()) or () if t.kind == "generation"]


def finish_reason_of(response: Any) -> str:
    """``"length"`` when the last answer-node run stopped at its ``max_tokens`` (or the
    context), else ``"stop"`` (also when the backend gives no node timings)."""
    runs = _generation_runs(response)
    answers = [t for t in runs if t.is_answer] or runs
    reason = getattr(answers[-1], "finish_reason", None) if answers else None
    return "length" if reason == "length" else "stop"


def usage_of(response: Any) -> dict | None:
    """OpenAI ``usage`` of the whole request: the prompt and generated tokens of every
    generation node run (query writing, summaries, drafts and the answer), from
    ``Response.node_timings``; ``None`` when the backend gives no node timings."""
    runs = _generation_runs(response)
    if not runs:
        return None
    prompt = sum(t.num_prompt_tokens for t in runs)
    completion = sum(t.num_tokens for t in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage_by_node(response: Any) -> list[dict] | None:
    """The extension ``usage_by_node``: one entry per generation node run, in order."""
    runs = _generation_runs(response)
    if not runs:
        return None
    return [
        {
            "node": t.node_id if isinstance(t.node_id, (int, str)) else str(t.node_id),
            "is_answer": t.is_answer,
            "prompt_tokens": t.num_prompt_tokens,
            "completion_tokens": t.num_tokens,
        }
        for t in runs
    ]


def _count_tokens(job: Job, response: Any) -> None:
    """Token counters (``model_name`` label) and the answer's inter-token latency."""
    usage = usage_of(response)
    if usage is None:
        return
    metrics = job.ctx.metrics
    metrics.prompt_tokens.labels(job.model).inc(usage["prompt_tokens"])
    metrics.generation_tokens.labels(job.model).inc(usage["completion_tokens"])
    for t in _generation_runs(response):
        if t.is_answer and t.first_token_at is not None and t.finished_at is not None:
            metrics.observe_itl(job.model, t.finished_at - t.first_token_at, t.num_tokens)


async def _events(
    job: Job,
    question: str,
    graph: Any,
    status: dict[str, str],
    include_usage: bool = False,
    extra: dict[str, Any] | None = None,
):
    """SSE events of one streamed answer; ``status["end"]`` is set when it ends by itself."""
    base = {
        "id": job.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": job.model,
    }

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return sse({**base, "choices": [choice], **extra})

    yield chunk({"role": "assistant", "content": ""})
    first = True
    final: list[Any] = []  # the Response, handed over by the Server before the stream ends
    try:
        deltas = job.ctx.server.stream(
            question, graph, request_id=job.request_id, on_response=final.append, **(extra or {})
        )
        async for delta in deltas:
            if not delta:
                continue
            if first:
                job.first_token()
                first = False
            yield chunk({"content": delta})
    except Exception as exc:
        status["end"] = "error"
        yield sse_error(exc, job.request_id)
        yield sse("[DONE]")
        return
    status["end"] = "ok"
    response = final[0] if final else None
    documents = documents_of(response) if response is not None else []
    if response is not None:
        _observe_retrieval(job, graph, response)
        _count_tokens(job, response)
    reason = finish_reason_of(response) if response is not None else "stop"
    yield chunk({}, reason, workflow=job.label, documents=documents)
    if include_usage:  # as OpenAI: one more chunk, no choices, the usage
        usage = usage_of(response) if response is not None else None
        by_node = usage_by_node(response) if response is not None else None
        yield sse({**base, "choices": [], "usage": usage, "usage_by_node": by_node})
    yield sse("[DONE]")


def _observe_timings(job: Job, graph: Any, response: Any) -> None:
    """TTFT (non-streaming: a stream observes its own first token) and retrieval latency."""
    ttft = getattr(response, "ttft", None)
    if ttft is not None:
        job.ctx.metrics.ttft.labels(job.label).observe(ttft)
    _observe_retrieval(job, graph, response)


def _observe_retrieval(job: Job, graph: Any, response: Any) -> None:
    """Per-run retrieval latency from ``Response.node_timings`` when the runtime gives them,
    else from the per-node ``timings`` of the contract."""
    metrics = job.ctx.metrics
    runs = getattr(response, "node_timings", None)
    if runs:
        seconds = [t.duration for t in runs if t.kind == "retrieval" and t.duration is not None]
    else:
        timings = response.timings or {}
        seconds = [timings[n] for n in retrieval_node_ids(graph) if n in timings]
    for value in seconds:
        metrics.retrieval.labels(job.label).observe(float(value))
