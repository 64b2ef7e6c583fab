"""The retrieval worker's operator tasks, run by ``StagedRetrievalRunner.run`` beside its searches:
embed (one embedder call per batch), rerank (ties keep the input order), upsert (strings get
``uuid5`` ids from the task id, so a retry writes the same ids). A bad task fails alone."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from ragserve.graph import Passage
from ragserve.runtime.errors import failed_result, isolated
from ragserve.scheduler.messages import (
    EmbedTask,
    OperatorResult,
    RerankTask,
    UpsertTask,
)

OPERATOR_TASKS = (EmbedTask, RerankTask, UpsertTask)


def split_operators(tasks: list) -> tuple[list, list]:
    ops = [t for t in tasks if isinstance(t, OPERATOR_TASKS)]
    if not ops:
        return [], tasks
    return ops, [t for t in tasks if not isinstance(t, OPERATOR_TASKS)]


def run_operators(runner: Any, tasks: list) -> list[OperatorResult]:
    """One ``OperatorResult`` per task, in order."""
    results: dict[str, OperatorResult] = {}
    embeds = [t for t in tasks if isinstance(t, EmbedTask)]
    if embeds:
        embedded = isolated(lambda ts: _embed(runner.embedder, ts), embeds, failed_result)
        results.update((r.task_id, r) for r in embedded)
    for t in tasks:
        if isinstance(t, RerankTask):
            results[t.task_id] = _guarded(t, _rerank, runner, t)
        elif isinstance(t, UpsertTask):
            results[t.task_id] = _guarded(t, _upsert, runner, t)
    return [results[t.task_id] for t in tasks]


def _embed(embedder: Any, tasks: list[EmbedTask]) -> list[OperatorResult]:
    texts = [text for t in tasks for text in t.texts]
    vectors = np.asarray(embedder.encode(texts, is_query=False), dtype=np.float32)
    out, pos = [], 0
    for t in tasks:
        rows = vectors[pos : pos + len(t.texts)]
        pos += len(t.texts)
        out.append(OperatorResult(t.task_id, rows[0].copy() if t.single else rows.copy()))
    return out


def _rerank(runner: Any, task: RerankTask) -> list[Passage]:
    reranker = runner.reranker
    if reranker is None:
        from ragserve.retrieval.rerank import EmbeddingReranker

        reranker = runner.reranker = EmbeddingReranker(runner.embedder)
    texts = [f"{p.title}: {p.text}" if p.title else p.text for p in task.passages]
    scores = np.asarray(reranker.score(task.query, texts), dtype=np.float32)
    if scores.shape != (len(texts),):
        raise RuntimeError(f"reranker returned {scores.shape} scores for {len(texts)} passages")
    order = np.argsort(-scores, kind="stable")[: task.topk]
    return [
        Passage(
            task.passages[i].doc_id, task.passages[i].text, task.passages[i].title, float(scores[i])
        )
        for i in order
    ]


def _upsert(runner: Any, task: UpsertTask) -> list[str]:
    from ragserve.retrieval import Document
    from ragserve.retrieval.limits import check_document

    docs = []
    for i, item in enumerate(task.documents):
        if isinstance(item, str):
            item = Document(uuid.uuid5(uuid.NAMESPACE_URL, f"{task.task_id}/{i}").hex, item)
        elif not isinstance(item, Document):
            item = Document(
                item.id,
                item.text,
                getattr(item, "title", None),
                dict(getattr(item, "metadata", None) or {}),
            )
        check_document(item, runner.document_limits, f"documents[{i}].")
        docs.append(item)
    runner.index.add_documents(docs)
    return [d.id for d in docs]


def _guarded(task: Any, fn: Any, *args: Any) -> OperatorResult:
    try:
        return OperatorResult(task.task_id, fn(*args))
    except Exception as exc:
        return failed_result(task, exc)
