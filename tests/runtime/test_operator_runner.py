"""The retrieval runner's operator tasks: batching, the rerank plug point, upsert checks."""

from __future__ import annotations

import numpy as np

from ragserve.graph import Passage
from ragserve.retrieval import Document
from ragserve.retrieval.rerank import BaseReranker
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import EmbedTask, OperatorResult, RerankTask, UpsertTask


class CountingEmbedder:
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], bool]] = []

    def encode(self, texts, *, is_query: bool):
        self.calls.append((list(texts), is_query))
        out = np.array([[len(t), 1.0] for t in texts], dtype=np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


class RecordingIndex:
    def __init__(self) -> None:
        self.added: list[list[Document]] = []

    def add_documents(self, docs) -> None:
        self.added.append(list(docs))


def _runner() -> StagedRetrievalRunner:
    return StagedRetrievalRunner(RecordingIndex(), CountingEmbedder())


def test_embed_tasks_of_a_batch_share_one_encode_call() -> None:
    runner = _runner()
    results = runner.run([EmbedTask("a", ("x",), single=True), EmbedTask("b", ("yy", "zzz"))])
    assert runner.embedder.calls == [(["x", "yy", "zzz"], False)]
    assert [r.task_id for r in results] == ["a", "b"]
    assert results[0].value.shape == (2,) and results[1].value.shape == (2, 2)
    np.testing.assert_array_equal(
        results[1].value, runner.embedder.encode(["yy", "zzz"], is_query=False)
    )


class LengthReranker(BaseReranker):
    def score(self, query, texts):
        return np.array([len(t) for t in texts], dtype=np.float32)


def test_rerank_uses_the_configured_reranker_else_the_embedder_cosine() -> None:
    passages = tuple(Passage(f"d{i}", "t" * n) for i, n in enumerate((3, 9, 5)))
    runner = _runner()
    runner.reranker = LengthReranker()
    (r,) = runner.run([RerankTask("k", "q", passages, topk=2)])
    assert [p.doc_id for p in r.value] == ["d1", "d2"] and [p.score for p in r.value] == [9, 5]
    default = _runner()
    (r,) = default.run([RerankTask("k", "q", passages, topk=3)])
    emb = default.embedder
    cos = (
        emb.encode([p.text for p in passages], is_query=False) @ emb.encode(["q"], is_query=True)[0]
    )
    assert [p.doc_id for p in r.value] == [
        passages[i].doc_id for i in np.argsort(-cos, kind="stable")
    ]


def test_upsert_generates_stable_ids_and_checks_documents() -> None:
    runner = _runner()
    doc = Document("kept-id", "A document.", "Title")
    (r,) = runner.run([UpsertTask("t/1", ("plain text", doc))])
    assert r.error is None and r.value[1] == "kept-id" and len(r.value[0]) == 32
    (again,) = _runner().run([UpsertTask("t/1", ("plain text",))])
    assert again.value == r.value[:1]  # a retried task writes the same id
    assert runner.index.added[0][0].text == "plain text"
    (bad,) = runner.run([UpsertTask("t/2", ("   ",))])
    assert isinstance(bad, OperatorResult) and bad.error_kind == "bad_request"
    assert "documents[0].text must not be empty" in bad.error
    assert len(runner.index.added) == 1  # nothing written for the bad task
