"""`StagedRetrievalRunner` answers tasks with a mode or filter through `VectorIndex.search_text`,
next to plain dense tasks in the same batch; a bad filter fails its own task only."""

from __future__ import annotations

import zlib

import numpy as np

from ragserve.retrieval import Document, VectorIndex
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import RetrievalTask


class Bow:
    name, dim = "bow", 16

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                out[i, zlib.crc32(w.encode()) % self.dim] += 1
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-6)
        return out


def _index() -> VectorIndex:
    words = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]
    docs = [
        Document(f"d{i}", f"{words[i % 8]} {words[(i * 3) % 8]} item{i}", None, {"k": i % 3})
        for i in range(120)
    ]
    emb = Bow()
    x = emb.encode([d.text for d in docs], is_query=False)
    return VectorIndex.from_vectors(docs, x, embedder_name="bow", nlist=4, embedder=emb)


def test_mixed_batch() -> None:
    vi = _index()
    runner = StagedRetrievalRunner(vi, vi.embedder)
    tasks = [
        RetrievalTask("plain", "red green", 4),
        RetrievalTask("bm25", "item7", 2, mode="bm25"),
        RetrievalTask("filtered", "blue", 5, filter={"k": 2}),
        RetrievalTask("bad", "blue", 5, filter={"k": {"near": 1}}),
        RetrievalTask("hybrid", "cyan item9", 3, mode="hybrid", filter={"k": [0, 1]}),
    ]
    results = runner.run(tasks)
    assert [r.task_id for r in results] == [t.task_id for t in tasks]
    by_id = {r.task_id: r for r in results}
    want = vi.search_text(["red green"], 4, mode="dense")[0]
    assert [p.doc_id for p in by_id["plain"].passages] == [h.id for h in want]
    assert by_id["bm25"].passages[0].doc_id == "d7"
    filtered = by_id["filtered"].passages
    assert len(filtered) == 5 and all(int(p.doc_id[1:]) % 3 == 2 for p in filtered)
    assert by_id["bad"].error is not None and "k" in by_id["bad"].error
    hybrid = by_id["hybrid"].passages
    assert [p.doc_id for p in hybrid] == [
        h.id for h in vi.search_text(["cyan item9"], 3, mode="hybrid", filter={"k": [0, 1]})[0]
    ]
    vi.close()


class Bow2(Bow):
    name, dim = "bow2", 12


def test_ensemble_tasks_equal_search_text() -> None:
    from ragserve.retrieval.ensemble import EnsembleConfig

    vi = _index()
    vi.enable_ensemble(EnsembleConfig("bow2", depth=20), embedder=Bow2())
    runner = StagedRetrievalRunner(vi, vi.embedder)
    tasks = [
        RetrievalTask("ens", "cyan item9 red", 4, mode="ensemble"),
        RetrievalTask("ens-f", "blue black", 3, mode="ensemble", filter={"k": 1}),
        RetrievalTask("hyb", "green white", 5, mode="hybrid"),
    ]
    by_id = {r.task_id: r for r in runner.run(tasks)}
    for t in tasks:
        want = vi.search_text([t.query], t.topk, mode=t.mode, filter=t.filter)[0]
        assert [p.doc_id for p in by_id[t.task_id].passages] == [h.id for h in want], t.task_id
        assert len(want) == t.topk
    assert all(int(p.doc_id[1:]) % 3 == 1 for p in by_id["ens-f"].passages)
    vi.close()
