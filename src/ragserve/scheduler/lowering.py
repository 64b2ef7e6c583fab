"""Lowering: a ready node run becomes the task of the resource its node kind declares.

``lower(run, node, task_id, memory)`` returns a ``Lowered`` naming the resource and its
payload:

| node kind          | resource    | payload                                               |
| ------------------ | ----------- | ----------------------------------------------------- |
| generation         | engine      | ``GenerationTask`` (chat template, history)           |
| completion         | engine      | ``GenerationTask`` (``chat=False``: the prompt as is) |
| retrieval          | retrieval   | ``RetrievalTask``                                     |
| embed/rerank/upsert| retrieval   | ``EmbedTask`` / ``RerankTask`` / ``UpsertTask``       |
| function           | cpu         | ``(fn, state snapshot, timeout_s)``                   |
| memory             | scheduler   | ``OperatorResult``: done inline, here                 |

Input the node cannot use (documents of a wrong type, a missing session id, ...) lowers to an
``OperatorResult`` with a ``bad_request`` error naming the node's field, so the request fails
cleanly and nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ragserve.graph import Passage
from ragserve.scheduler.memory_store import MemoryStore
from ragserve.scheduler.messages import (
    EmbedTask,
    GenerationParams,
    GenerationTask,
    OperatorResult,
    RerankTask,
    RetrievalTask,
    UpsertTask,
)
from ragserve.scheduler.request import NodeRun


class Lowered(NamedTuple):
    """``resource``: ``engine``, ``retrieval``, ``operators`` (retrieval worker operators),
    ``cpu`` or ``inline`` (an ``OperatorResult`` ready now)."""

    resource: str
    payload: Any


def lower(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    try:
        return _LOWER[node.kind](run, node, task_id, memory)
    except ValueError as exc:
        return Lowered("inline", OperatorResult(task_id, error=str(exc), error_kind="bad_request"))


def _generation(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    params = GenerationParams.for_node(node)
    prompt = node.prompt.render(run.state)
    return Lowered(
        "engine", GenerationTask(task_id, prompt, params, history=node.history(run.state))
    )


def _completion(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    prompt = run.state.get(node.prompt)
    if isinstance(prompt, list):
        prompt = tuple(prompt)
    ok = isinstance(prompt, str) or (
        isinstance(prompt, tuple)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not ok:
        raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.60}")
    params = GenerationParams.from_any(node.params)
    return Lowered("engine", GenerationTask(task_id, prompt, params, chat=False))


def _retrieval(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    query = node.query.render(run.state)
    task = RetrievalTask(
        task_id, query, node.topk, node.nprobe, node.mode, node.filter, node.collapse_sections
    )
    return Lowered("retrieval", task)


def _embed(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    value = run.state.get(node.text)
    if isinstance(value, str):
        return Lowered("operators", EmbedTask(task_id, (value,), single=True))
    if _is_list(value) and value and all(isinstance(v, str) for v in value):
        return Lowered("operators", EmbedTask(task_id, tuple(value)))
    raise ValueError(f"text: state[{node.text!r}] must be a string or a non-empty list of strings")


def _rerank(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    docs = run.state.get(node.docs)
    docs = [docs] if isinstance(docs, Passage) else docs
    if not _is_list(docs) or not all(isinstance(p, Passage) for p in docs):
        raise ValueError(f"docs: state[{node.docs!r}] must be retrieved passages")
    if not docs:
        return Lowered("inline", OperatorResult(task_id, []))
    task = RerankTask(task_id, node.query.render(run.state), tuple(docs), node.topk)
    return Lowered("operators", task)


def _upsert(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    value = run.state.get(node.documents)
    items = list(value) if _is_list(value) else [value]
    for item in items:
        if not (isinstance(item, str) or (hasattr(item, "id") and hasattr(item, "text"))):
            raise ValueError(
                f"documents: state[{node.documents!r}] must be a Document, a string or a list "
                f"of them, got {type(item).__name__}"
            )
    if not items:
        return Lowered("inline", OperatorResult(task_id, []))
    return Lowered("operators", UpsertTask(task_id, tuple(items)))


def _function(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    return Lowered("cpu", (node.fn, run.state.fork(), node.timeout_s))


def _memory(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> Lowered:
    session = run.state.get(node.key)
    if not isinstance(session, str) or not session:
        raise ValueError(f"key: state[{node.key!r}] must hold a non-empty session id string")
    if node.mode == "read":
        return Lowered("inline", OperatorResult(task_id, memory.read(session)))
    stored = memory.append(session, node.text.render(run.state))
    return Lowered("inline", OperatorResult(task_id, stored))


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


_LOWER = {
    "generation": _generation,
    "completion": _completion,
    "retrieval": _retrieval,
    "embed": _embed,
    "rerank": _rerank,
    "upsert": _upsert,
    "function": _function,
    "memory": _memory,
}
