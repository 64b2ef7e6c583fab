"""BM25 and dense stay in sync through a SIGKILL of the writing process: after a reload the
Faiss ids, the document store and the BM25 index hold the same passages, and BM25 scores equal
a BM25 index built afresh from the store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from itertools import pairwise

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.bm25 import BM25Index, passage_text

WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from ragserve.retrieval import Document, VectorIndex
    vi = VectorIndex.load(sys.argv[1])
    vi.compact_every = int(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    for i in range(100000):
        if i % 4 == 3:
            victim = f"w{int(rng.integers(0, i))}"
            print("try del", victim, flush=True)
            vi.delete_documents([victim])
        else:
            print("try add", f"w{i}", flush=True)
            vec = rng.normal(size=(1, vi.dim)).astype("float32")
            vi.add_documents([Document(f"w{i}", f"fresh term{i} and shared words")], vec)
        print("ok", flush=True)
    """
)


@pytest.fixture
def saved(tmp_path, make_corpus):
    docs, x = make_corpus(300)
    docs = [Document(d.id, f"{d.text} shared words {i % 13}", d.title) for i, d in enumerate(docs)]
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8)
    vi.bm25()
    vi.save(tmp_path / "idx")
    vi.close()
    return tmp_path / "idx"


@pytest.mark.integration
@pytest.mark.parametrize("seed", range(3))
def test_sigkill_keeps_bm25_and_dense_in_sync(saved, seed):
    rng = np.random.default_rng(seed)
    kill_after = int(rng.integers(5, 40))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(saved), str([3, 1000, 1][seed]), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while sum(line == "ok" for line in lines) < kill_after:
        line = proc.stdout.readline()
        assert line, f"writer exited early with {proc.wait()}"
        lines.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines += [line.strip() for line in proc.stdout.read().splitlines()]
    acked = [tuple(t.split()[1:]) for t, ok in pairwise(lines) if ok == "ok"]

    vi = VectorIndex.load(saved)
    vi.check_integrity()  # Faiss ids == store rows == BM25 rows
    live = set()
    for op, doc_id in acked:
        (live.add if op == "add" else live.discard)(doc_id)
    in_flight = lines[-1].split()[1:] if lines[-1].startswith("try") else None
    if in_flight is not None:
        live.discard(in_flight[1])
    queries = [f"fresh term{doc_id[1:]}" for doc_id in sorted(live)] + ["shared words 7"]
    rows = vi.allowed_row_ids({})
    fresh = BM25Index.from_texts(rows, [passage_text(d) for d in vi.get_documents(rows)])
    got, want = vi.bm25().search(queries, 10), fresh.search(queries, 10)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)
    for doc_id, hits in zip(sorted(live), vi.search_text(queries, 1, mode="bm25"), strict=False):
        assert hits and hits[0].id == doc_id  # every acknowledged passage is found by its term
    vi.close()
