"""Map a chat request onto a compiled workflow: ``model: "ragserve/hyde"`` (or the
``workflow`` extension) picks ``Server.workflows["hyde"]``; the request's knobs apply to a
tuned copy (the compiled graph is never mutated)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ragserve.server.errors import APIError, model_not_found

MODEL_PREFIX = "ragserve/"
LLM_LABEL = "llm"  # the ``workflow`` label in /metrics of chats with the LLM itself
RETRIEVAL_KNOBS = ("topk", "nprobe", "mode", "filter")
ANSWER_KNOBS = ("max_tokens", "temperature", "top_p", "seed")


@functools.cache
def llm_chat_graph() -> Any:
    """Chat with the LLM itself: one answer node whose prompt is the question (the messages
    before it reach the chat template as history)."""
    from ragserve.graph import END, START, RAGraph

    g = RAGraph(LLM_LABEL).add_generation(0, prompt="{input}")
    return g.add_edge(START, 0).add_edge(0, END).compile()


def workflow_model_ids(workflows: Mapping[str, Any]) -> list[str]:
    return [MODEL_PREFIX + name for name in workflows]


def resolve_workflow(
    workflows: Mapping[str, Any], model: str, workflow: str | None, llm_id: str | None = None
) -> tuple[str, Any]:
    """``(name, compiled graph)`` for the request, or a 404 naming the known models. ``model``
    equal to ``llm_id`` (the served model name) is a chat with the LLM itself
    (``(LLM_LABEL, llm_chat_graph())``)."""
    if workflow is None and llm_id is not None and model == llm_id:
        return LLM_LABEL, llm_chat_graph()
    name = workflow if workflow is not None else model.removeprefix(MODEL_PREFIX)
    graph = workflows.get(name)
    if graph is None:
        known = ", ".join([*workflow_model_ids(workflows), *([llm_id] if llm_id else [])])
        what = f"workflow {workflow!r}" if workflow is not None else f"model {model!r}"
        raise model_not_found(f"{what} does not exist; known: {known or '(none)'}")
    return name, graph


def tune_graph(graph: Any, *, stop: tuple[str, ...] = (), **knobs: Any) -> Any:
    """A copy of ``graph`` (itself without overrides) whose retrieval nodes take the given
    ``RETRIEVAL_KNOBS`` and whose answer nodes (generations writing ``"output"``) take the
    ``ANSWER_KNOBS`` and add ``stop``; intermediate generations keep theirs. ``None`` is "not
    given"."""
    if unknown := set(knobs) - {*RETRIEVAL_KNOBS, *ANSWER_KNOBS}:
        raise TypeError(f"tune_graph() got unknown knobs {sorted(unknown)}")
    retrieval = {k: knobs[k] for k in RETRIEVAL_KNOBS if knobs.get(k) is not None}
    answer = {k: knobs[k] for k in ANSWER_KNOBS if knobs.get(k) is not None}
    if not retrieval and not answer and not stop:
        return graph
    nodes = {}
    for node_id, node in graph.nodes.items():
        if node.kind == "retrieval" and retrieval:
            node = dataclasses.replace(node, **retrieval)
        elif node.kind == "generation" and node.output == "output" and (answer or stop):
            merged_stop = tuple(dict.fromkeys((*node.stop, *stop)))
            node = dataclasses.replace(node, **answer, stop=merged_stop)
        nodes[node_id] = node
    return dataclasses.replace(graph, nodes=MappingProxyType(nodes))


def request_inputs_or_400(name: str, graph: Any, inputs: Mapping[str, Any] | None) -> dict:
    """``inputs`` for ``Server.submit``: exactly the keys the workflow declares
    (``RAGraph(inputs=...)``), else a 400 naming the key (``param`` ``inputs.<key>``)."""
    given = dict(inputs or {})
    declared = tuple(getattr(graph, "inputs", ()))
    unknown = [k for k in given if k not in declared]
    missing = [k for k in declared if k not in given]
    if unknown or missing:
        key = (unknown or missing)[0]
        takes = ", ".join(declared) or "none"
        problem = f"has no input {key!r} (it takes: {takes})" if unknown else f"needs input {key!r}"
        message = f"inputs: workflow {name!r} {problem}"
        raise APIError(400, message, param=f"inputs.{key}", code="invalid_request")
    return given
