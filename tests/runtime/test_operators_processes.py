"""Every operator node end to end through the real worker processes (spawned engine and
retrieval workers), on the tiny model and a copy of the small index."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ragserve.graph import END, START, RAGraph
from ragserve.runtime import Server, ServerConfig
from ragserve.scheduler import OperatorConfig

pytestmark = pytest.mark.integration

ATLANTIS = "The capital of Atlantis is Poseidonia, a city of bronze gates."


@pytest.fixture(scope="module")
def index_copy(small_index: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(shutil.copytree(small_index, tmp_path_factory.mktemp("ops") / "index"))


@pytest.fixture(scope="module")
def server(tiny_model: str, index_copy: str):
    config = ServerConfig(
        engine_kwargs={"device": "cpu"}, operators=OperatorConfig(function_timeout_s=5.0)
    )
    with Server(tiny_model, index_copy, config=config) as s:
        yield s


def _agent() -> RAGraph:
    """memory -> function -> upsert -> (retrieve -> rerank | embed) -> answer -> memory."""
    g = RAGraph("agent", inputs=("session",))
    g.add_memory("recall", key="session", output="memory")
    g.add_function("notes", lambda s: [ATLANTIS, f"Asked: {s['input']}"], output="notes")
    g.add_upsert("save", documents="notes", output="saved")
    g.add_retrieval("search", query="input", topk=4, output="docs")
    g.add_rerank("rerank", query="input", docs="docs", topk=2, output="best")
    g.add_embed("embed", text="input", output="vector")
    g.add_generation("answer", prompt="{memory}\n\n{best}\n\n{input}", max_tokens=4)
    g.add_memory("remember", key="session", mode="append", text="{input}")
    g.add_edge(START, "recall").add_edge("recall", "notes").add_edge("notes", "save")
    g.add_edge("save", ("search", "embed")).add_edge("search", "rerank")
    g.add_edge("rerank", "answer").add_edge("embed", "answer")
    return g.add_edge("answer", "remember").add_edge("remember", END)


def test_every_operator_through_the_worker_processes(server: Server) -> None:
    from ragserve.retrieval import load_embedder

    q = "What is the capital of Atlantis?"
    first = server.run(q, _agent(), inputs={"session": "s1"})
    assert first.error is None, first.error
    kinds = [t.kind for t in first.node_timings]
    assert kinds[:3] == ["memory", "function", "upsert"] and kinds[-2:] == ["generation", "memory"]
    assert sorted(kinds[3:6]) == ["embed", "rerank", "retrieval"]
    saved = first.state["saved"]
    assert len(saved) == 2 and all(len(i) == 32 for i in saved)  # generated ids
    assert first.state["memory"] == []
    # the upsert is visible to the same request's later retrieval
    assert saved[0] in [p.doc_id for p in first.state["docs"]]
    # embed: the index's embedder, document side, as Server.embed
    np.testing.assert_allclose(first.state["vector"], server.embed([q]).vectors[0], atol=1e-5)
    # rerank: the embedder's cosine of query (query side) and passage (document side)
    emb = load_embedder("all-minilm-l6-v2")
    docs = first.state["docs"]
    texts = [f"{p.title}: {p.text}" if p.title else p.text for p in docs]
    cos = emb.encode(texts, is_query=False) @ emb.encode([q], is_query=True)[0]
    best = [docs[i].doc_id for i in np.argsort(-cos, kind="stable")[:2]]
    assert [p.doc_id for p in first.state["best"]] == best
    assert [p.score for p in first.state["best"]] == pytest.approx(sorted(cos)[::-1][:2], abs=1e-5)
    second = server.run("And its gates?", _agent(), inputs={"session": "s1"})
    assert second.error is None and second.state["memory"] == [q]
    other = server.run("Unrelated", _agent(), inputs={"session": "s2"})
    assert other.state["memory"] == []


def test_completion_node_through_the_worker_processes(server: Server) -> None:
    from ragserve.generation import SamplingParams

    async def go():
        return [o async for o in server.complete([1, 2, 3], SamplingParams(max_tokens=3))]

    outs = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert outs[-1].finished and outs[-1].prompt_token_ids == [1, 2, 3]
    assert outs[-1].finish_reason in ("length", "stop") and 1 <= len(outs[-1].token_ids) <= 3
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for a, b in zip(outs, outs[1:], strict=False):  # cumulative ids and text
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)


def test_missing_graph_input_is_a_clear_error(server: Server) -> None:
    with pytest.raises(ValueError, match="inputs: the graph needs 'session'"):
        server.run("q", _agent())


def test_function_failures_fail_only_their_request_through_processes(server: Server) -> None:
    def graph(fn, **kw):
        g = RAGraph().add_retrieval(0, query="input", topk=2, output="docs")
        g.add_function(1, fn, output="x", **kw).add_generation(2, prompt="{x}", max_tokens=2)
        return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, END).compile()

    def boom(state):
        raise RuntimeError("tool broke")

    async def go():
        jobs = [
            server.submit("q1", graph(boom)),
            server.submit("q2", graph(lambda s: time.sleep(3), timeout_s=0.3)),
            *[server.submit(f"q{i}", graph(lambda s: s["docs"][0].title)) for i in range(3, 6)],
        ]
        return await asyncio.gather(*jobs)

    results = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert results[0].error == "node 1 failed: function raised RuntimeError: tool broke"
    assert results[1].error == "node 1 failed: function timed out after 0.3 s"
    assert [r.error for r in results[2:]] == [None] * 3
    assert all(r.state["x"] == r.state["docs"][0].title for r in results[2:])


def test_fanout_retrievals_go_out_as_one_batch_and_merge(server: Server) -> None:
    g = RAGraph()
    g.add_retrieval("a", query="input", topk=2, output="docs_a")
    g.add_retrieval("b", query="Which country is in Asia? {input}", topk=2, output="docs_b")
    g.add_generation("join", prompt="{docs_a}\n\n{docs_b}\n\n{input}", max_tokens=3)
    g.add_edge(START, ("a", "b")).add_edge("a", "join").add_edge("b", "join")
    r = server.run("What is the capital of Peru?", g.add_edge("join", END))
    assert r.error is None
    a, b = r.node_timings[0], r.node_timings[1]
    assert {a.kind, b.kind} == {"retrieval"} and a.dispatched_at == b.dispatched_at
    ids = [p.doc_id for p in r.state["docs_a"]] + [p.doc_id for p in r.state["docs_b"]]
    assert list(r.doc_ids) == list(dict.fromkeys(ids))
    # the same two retrievals one after the other (no fan-out) find the same passages
    g = RAGraph()
    g.add_retrieval("a", query="input", topk=2, output="docs_a")
    g.add_retrieval("b", query="Which country is in Asia? {input}", topk=2, output="docs_b")
    g.add_edge(START, "a").add_edge("a", "b").add_edge("b", END)
    seq = server.run("What is the capital of Peru?", g)
    for key in ("docs_a", "docs_b"):
        assert [p.doc_id for p in r.state[key]] == [p.doc_id for p in seq.state[key]]
    assert r.doc_ids == seq.doc_ids


UPSERT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ragserve.graph import END, START, RAGraph
    from ragserve.runtime import Server, ServerConfig

    def main():
        model, index, marker = sys.argv[1:4]
        def done(state):  # runs after the upsert node completed
            Path(marker).write_text(",".join(state["ids"]))
            time.sleep(600)
        g = RAGraph().add_upsert(0, documents="input", output="ids")
        g.add_function(1, done, output="x", timeout_s=600)
        g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END)
        with Server(model, index, config=ServerConfig(engine_kwargs={"device": "cpu"})) as s:
            s.run("The capital of Lemuria is Mu, on the sunken plateau.", g)

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.slow
def test_upserted_documents_survive_a_sigkill_after_the_node(
    tiny_model: str, small_index: str, tmp_path: Path
) -> None:
    index = shutil.copytree(small_index, tmp_path / "index")
    script, marker = tmp_path / "serve.py", tmp_path / "ids"
    script.write_text(UPSERT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_model, str(index), str(marker)], env=env
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (doc_id,) = marker.read_text().split(",")
    time.sleep(1.0)  # the orphaned retrieval worker notices its parent is gone and exits
    from ragserve.retrieval import VectorIndex

    reopened = VectorIndex.load(str(index))
    try:
        (doc,) = reopened.get_documents([doc_id])
        assert doc is not None and "Lemuria" in doc.text
    finally:
        reopened.close()
