"""Lowering: a ready node run becomes the task of the resource its node kind declares (the
table: docs/architecture.md, "Operators and the life of a request"). Input the node cannot
use lowers to a ``bad_request`` ``OperatorResult`` naming the field: nothing is sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ragserve.graph import Passage
from ragserve.scheduler.messages import (
    EmbedTask,
    GenerationParams,
    GenerationTask,
    OperatorResult,
    RerankTask,
    RetrievalTask,
    UpsertTask,
)
from ragserve.scheduler.operators import MemoryStore
from ragserve.scheduler.request import NodeRun


class Lowered(NamedTuple):
    """``resource``: a ``Wavefront`` list (``generation``, ``retrieval``, ``operators``),
    ``cpu`` (``(fn, state, timeout_s)``) or ``inline`` (an ``OperatorResult`` ready now)."""

    resource: str
    payload: Any


def lower(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    try:
        return _lower(run.state, node, task_id, memory)
    except ValueError as exc:
        return Lowered("inline", OperatorResult(task_id, error=str(exc), error_kind="bad_request"))


def _lower(state: Any, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    kind = node.kind
    if kind == "generation":
        return Lowered("generation", generation_task(task_id, node, state))
    if kind == "completion":
        prompt = state.get(node.prompt)
        prompt = tuple(prompt) if isinstance(prompt, list) else prompt
        if not isinstance(prompt, str) and not (
            isinstance(prompt, tuple)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.60}")
        params = GenerationParams.from_any(node.params)
        return Lowered("generation", GenerationTask(task_id, prompt, params, chat=False))
    if kind == "retrieval":
        query = node.query.render(state)
        fields = (node.topk, node.nprobe, node.mode, node.filter, node.collapse_sections)
        return Lowered("retrieval", RetrievalTask(task_id, query, *fields))
    if kind == "embed":
        value = state.get(node.text)
        if isinstance(value, str):
            return Lowered("operators", EmbedTask(task_id, (value,), single=True))
        if not (_is_list(value) and value and all(isinstance(v, str) for v in value)):
            raise ValueError(
                f"text: state[{node.text!r}] must be a string or a non-empty list of strings"
            )
        return Lowered("operators", EmbedTask(task_id, tuple(value)))
    if kind == "rerank":
        docs = state.get(node.docs)
        docs = [docs] if isinstance(docs, Passage) else docs
        if not _is_list(docs) or not all(isinstance(p, Passage) for p in docs):
            raise ValueError(f"docs: state[{node.docs!r}] must be retrieved passages")
        if not docs:
            return Lowered("inline", OperatorResult(task_id, []))
        task = RerankTask(task_id, node.query.render(state), tuple(docs), node.topk)
        return Lowered("operators", task)
    if kind == "upsert":
        value = state.get(node.documents)
        items = list(value) if _is_list(value) else [value]
        for item in items:
            if not (isinstance(item, str) or (hasattr(item, "id") and hasattr(item, "text"))):
                raise ValueError(
                    f"documents: state[{node.documents!r}] must be a Document, a string or a "
                    f"list of them, got {type(item).__name__}"
                )
        if not items:
            return Lowered("inline", OperatorResult(task_id, []))
        return Lowered("operators", UpsertTask(task_id, tuple(items)))
    if kind == "function":
        return Lowered("cpu", (node.fn, state.fork(), node.timeout_s))
    session = state.get(node.key)  # a memory node: done here
    if not isinstance(session, str) or not session:
        raise ValueError(f"key: state[{node.key!r}] must hold a non-empty session id string")
    if node.mode == "read":
        return Lowered("inline", OperatorResult(task_id, memory.read(session)))
    return Lowered(
        "inline", OperatorResult(task_id, memory.append(session, node.text.render(state)))
    )


def generation_task(task_id: str, node: Any, state: Any) -> GenerationTask:
    """The task of a ``GenerationNode`` reading ``state``."""
    params = GenerationParams.from_any(node)
    return GenerationTask(task_id, node.prompt.render(state), params, history=node.history(state))


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
