"""The default runtime: engine and index in persistent worker processes (spawn)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from test_workflows_e2e import small_workflow

from ragserve.graph import END, START, RAGraph
from ragserve.runtime import Server, ServerConfig
from ragserve.workflows import BUILTIN_WORKFLOWS

pytestmark = pytest.mark.integration


@pytest.fixture
def server(process_server: Server) -> Server:
    return process_server


def _long_graph(max_tokens: int = 200) -> object:
    g = RAGraph().add_retrieval(0, query="input", topk=2, output="docs")
    g.add_generation(1, prompt="{docs}\n{input}", max_tokens=max_tokens)
    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END).compile()


def test_concurrent_mixed_requests_equal_each_alone(server: Server) -> None:
    names = sorted(BUILTIN_WORKFLOWS)
    jobs = [
        (f"What is the capital of country number {i}?", names[i % 5]) for i in range(10)
    ]  # each workflow twice
    graphs = {n: small_workflow(n) for n in names}

    async def together():
        return await asyncio.gather(*(server.submit(q, graphs[n]) for q, n in jobs))

    before = server.stats()
    concurrent = asyncio.run(asyncio.wait_for(together(), timeout=300))
    alone = [server.run(q, graphs[n]) for q, n in jobs]
    stats = server.stats()
    num_nodes = sum(len(r.node_timings) for r in [*concurrent, *alone])
    assert stats["num_node_runs"] - before["num_node_runs"] == num_nodes
    assert stats["scheduler_busy_s"] > before["scheduler_busy_s"]
    assert stats["scheduler_s_per_node"] == stats["scheduler_busy_s"] / stats["num_node_runs"]
    assert [r.error for r in concurrent] == [None] * len(jobs)
    assert [r.output for r in concurrent] == [r.output for r in alone]
    assert [r.doc_ids for r in concurrent] == [r.doc_ids for r in alone]
    # NOTE: batched embedding moves passage scores by float rounding; ids and texts are equal.
    assert [_plain(r.state) for r in concurrent] == [_plain(r.state) for r in alone]


def _plain(state: dict) -> dict:
    return {
        k: [(p.doc_id, p.text) for p in v] if isinstance(v, list) else v for k, v in state.items()
    }


def test_documents_are_upserted_through_the_retrieval_worker(server: Server) -> None:
    from ragserve.retrieval import Document

    doc = Document("atlantis-1", "The capital of Atlantis is Poseidonia.", "Atlantis")
    server.add_documents([doc])
    r = server.run("What is the capital of Atlantis?", small_workflow("oneshot"))
    assert r.doc_ids[0] == "atlantis-1" and "Poseidonia" in r.state["docs"][0].text
    assert server.delete_documents(["atlantis-1"]) == 1
    r = server.run("What is the capital of Atlantis?", small_workflow("oneshot"))
    assert "atlantis-1" not in r.doc_ids


def _kill_worker(server: Server, name: str) -> None:
    os.kill(server.executor.workers[name].proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("worker", ["gen", pytest.param("ret", marks=pytest.mark.slow)])
def test_killed_worker_is_restarted_and_nothing_hangs(server: Server, worker: str) -> None:
    restarts = server.stats()["workers"][worker]["restarts"]

    graph = _long_graph(200 if worker == "gen" else 8)

    async def go():
        tasks = [asyncio.ensure_future(server.submit(f"q{i}?", graph)) for i in range(3)]
        deadline = time.monotonic() + 60
        while worker == "gen" and server.stats()["workers"]["gen"]["in_flight"] == 0:
            assert time.monotonic() < deadline  # wait until generation has started
            await asyncio.sleep(0.01)
        _kill_worker(server, worker)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    results = asyncio.run(go())
    errors = [r.error for r in results if r.error is not None]
    assert [r.error_kind for r in results if r.error is not None] == ["worker_died"] * len(errors)
    assert all(r.error_kind is None for r in results if r.error is None)
    if worker == "gen":  # every request was generating or queued for generation
        assert errors and all("generation worker died (exit code -9)" in e for e in errors)
    assert all("worker died" in e for e in errors)
    assert server.stats()["workers"][worker]["restarts"] == restarts + 1
    after = server.run("What is the capital of Chile?", small_workflow("oneshot"))
    assert after.error is None and "Chile" in after.titles


@pytest.mark.slow
def test_worker_that_cannot_restart_fails_requests_clearly(
    tiny_model: str, small_index: str, tmp_path
) -> None:
    import shutil

    model = shutil.copytree(tiny_model, tmp_path / "model")
    config = ServerConfig(engine_kwargs={"device": "cpu"})
    with Server(str(model), small_index, config=config) as s:
        shutil.rmtree(model)  # the next start of the generation worker fails
        _kill_worker(s, "gen")
        errors = []
        for _ in range(8):  # every request ends: with a restart error, then at once
            r = s.run("What is the capital of Chile?", small_workflow("oneshot"))
            errors.append(r.error)
            if "cannot be restarted" in r.error:
                break
        assert all("generation worker" in e for e in errors)
        assert r.error_kind == "worker_died"
        assert "generation worker cannot be restarted (3 failed starts)" in errors[-1]
        assert "is neither a folder nor a built-in name" in errors[-1]
        assert s.stats()["workers"]["gen"]["broken"] is True
        assert s.stats()["workers"]["ret"]["alive"] is True
