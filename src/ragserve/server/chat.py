"""``POST /v1/chat/completions``: a RAG workflow (``model``, or the ``workflow`` extension)
answers the last user message, or the LLM itself (the served model name) chats, no retrieval.
Extensions (the README's HTTP section): ``documents``, ``usage_by_node``, ``workflow``,
``inputs``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server.context import Job, choice, get_context, usage
from ragserve.server.errors import APIError, error_for_kind
from ragserve.server.graphs import LLM_LABEL, request_inputs_or_400, resolve_workflow, tune_graph
from ragserve.server.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = get_context(request)
    llm_id = ctx.config.served_model_name
    name, graph = resolve_workflow(ctx.server.workflows, body.model, body.workflow, llm_id)
    is_llm = name == LLM_LABEL and body.workflow is None and body.model == llm_id
    knobs = {k: getattr(body, k) for k in ("topk", "nprobe", "mode", "filter", "top_p", "seed")}
    try:
        graph = tune_graph(
            graph,
            **knobs,
            max_tokens=body.token_limit() or (ctx.config.default_max_tokens if is_llm else None),
            # OpenAI's default temperature for the LLM itself, as /v1/completions
            temperature=1.0 if is_llm and body.temperature is None else body.temperature,
            stop=body.stop_strings(),
        )
    except ValueError as exc:  # an override out of a node's range
        raise APIError(400, f"invalid request parameters: {exc}", code="invalid_request") from exc
    # NOTE: ``history`` only when there is one: a single-turn chat is a plain ``submit``.
    extra: dict[str, Any] = {"history": history} if (history := body.history()) else {}
    if inputs := request_inputs_or_400(name, graph, body.inputs):
        extra["inputs"] = inputs
    job = Job.admit(ctx, "chatcmpl", name, body.model)
    if body.stream:
        chunks = _chunks(job, body.question(), graph, body.include_usage(), extra)
        return job.stream("chat.completion.chunk", chunks)
    work = ctx.server.submit(body.question(), graph, request_id=job.request_id, **extra)
    response = await job.wait(request, work, check=_raise_if_failed)
    if response is None:
        return HTTPResponse(status_code=499)
    if (ttft := getattr(response, "ttft", None)) is not None:
        ctx.metrics.ttft.labels(job.label).observe(ttft)
    _observe(job, graph, response)
    message = {"role": "assistant", "content": response.output}
    return {
        **job.head("chat.completion"),
        "choices": [choice(message=message, finish_reason=finish_reason_of(response))],
        **usage_of(response),
        "workflow": name,
        "documents": documents_of(response),
    }


def _raise_if_failed(response: Any) -> None:
    if response.error is not None:
        kind = getattr(response, "error_kind", None)
        raise error_for_kind(kind, str(response.error), getattr(response, "request_id", None))


async def _chunks(job: Job, question: str, graph: Any, include_usage: bool, extra: dict):
    """The chunks of one streamed answer; the last holds ``documents`` and ``workflow``."""
    yield {"choices": [choice(delta={"role": "assistant", "content": ""}, finish_reason=None)]}
    final: list[Any] = []  # the Response, handed over by the Server before the stream ends
    server = job.ctx.server
    async for delta in server.stream(
        question, graph, request_id=job.request_id, on_response=final.append, **extra
    ):
        if delta:
            job.first_token()
            yield {"choices": [choice(delta={"content": delta}, finish_reason=None)]}
    job.status = "ok"
    response = final[0] if final else None
    if response is not None:
        _observe(job, graph, response)
    last = choice(delta={}, finish_reason=finish_reason_of(response))
    yield {"choices": [last], "workflow": job.label, "documents": documents_of(response)}
    if include_usage:  # as OpenAI: one more chunk, no choices, the usage
        yield {"choices": [], **usage_of(response)}


def documents_of(response: Any) -> list[dict]:
    """``[{"id", "title"}]`` of the retrieved documents, with ``text`` and ``score`` added when
    the final state still holds the passage (``state["docs"]`` of the built-in workflows)."""
    if response is None:
        return []
    passages: dict[str, Any] = {}
    for value in (response.state or {}).values():
        if isinstance(value, (list, tuple)):
            for item in value:
                if getattr(item, "doc_id", None) is not None:
                    passages.setdefault(item.doc_id, item)
    titles = list(response.titles or ())
    docs = []
    for i, doc_id in enumerate(response.doc_ids):
        doc = {"id": doc_id, "title": titles[i] if i < len(titles) else None}
        if (passage := passages.get(doc_id)) is not None:
            doc.update(text=passage.text, score=getattr(passage, "score", None))
        docs.append(doc)
    return docs


def _generation_runs(response: Any) -> list[Any]:
    return [t for t in getattr(response, "node_timings", ()) or () if t.kind == "generation"]


def finish_reason_of(response: Any) -> str:
    """``"length"`` when the last answer-node run stopped at its ``max_tokens`` (or the
    context), else ``"stop"`` (also when the backend gives no node timings)."""
    runs = _generation_runs(response)
    answers = [t for t in runs if t.is_answer] or runs
    reason = getattr(answers[-1], "finish_reason", None) if answers else None
    return "length" if reason == "length" else "stop"


def usage_of(response: Any) -> dict:
    """OpenAI ``usage`` of every generation node run (query writing, summaries, drafts and the
    answer) and the extension ``usage_by_node`` (one entry per run, in order); both ``None``
    when the backend gives no node timings."""
    runs = _generation_runs(response)
    if not runs:
        return {"usage": None, "usage_by_node": None}
    by_node = [
        {
            "node": t.node_id if isinstance(t.node_id, (int, str)) else str(t.node_id),
            "is_answer": t.is_answer,
            "prompt_tokens": t.num_prompt_tokens,
            "completion_tokens": t.num_tokens,
        }
        for t in runs
    ]
    total = usage(sum(t.num_prompt_tokens for t in runs), sum(t.num_tokens for t in runs))
    return {"usage": total, "usage_by_node": by_node}


def _observe(job: Job, graph: Any, response: Any) -> None:
    """Token counters, the answer's inter-token latency and the retrieval latency (per run
    from ``Response.node_timings`` when the runtime gives them, else from ``timings``)."""
    metrics = job.ctx.metrics
    runs = getattr(response, "node_timings", None)
    if runs:
        seconds = [t.duration for t in runs if t.kind == "retrieval" and t.duration is not None]
    else:
        timings = response.timings or {}
        ids = [n.node_id for n in graph.nodes.values() if n.kind == "retrieval"]
        seconds = [timings[n] for n in ids if n in timings]
    for value in seconds:
        metrics.retrieval.labels(job.label).observe(float(value))
    total = usage_of(response)["usage"]
    if total is None:
        return
    metrics.count_tokens(job.model, total["prompt_tokens"], total["completion_tokens"])
    for t in _generation_runs(response):
        if t.is_answer:
            metrics.observe_itl(job.model, t.first_token_at, t.finished_at, t.num_tokens)
