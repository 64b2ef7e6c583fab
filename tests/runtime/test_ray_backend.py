"""The Ray backend: 2 LLM replicas + 2 index shards as actors of one local Ray cluster (CPU,
tiny model) answer exactly like the single-process backend, survive killed actors, and
report per-actor stats. One cluster for the whole module; starting it takes ~16 s, so the module
runs in ``make test-all`` (slow). The executor's fault handling and the placement plan keep
their contract tests in the default tier (test_ray_executor_faults.py, test_ray_placement.py)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from test_server_processes import _long_graph, _plain
from test_workflows_e2e import EXTRA, small_workflow

from ragserve.runtime import Server, ServerConfig
from ragserve.workflows import BUILTIN_WORKFLOWS, get_workflow

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTIONS = ["What is the capital of Kenya?", "Where is Peru?", "Which country has Rome?"]


@pytest.fixture(scope="module")
def ray_server(tiny_model: str, small_index: str, tmp_path_factory: pytest.TempPathFactory):
    index = tmp_path_factory.mktemp("ray-index") / "small"
    shutil.copytree(small_index, index)  # the shards are split next to it and then written
    config = ServerConfig(
        backend="ray",
        num_llm_replicas=2,
        num_index_shards=2,
        ray_num_cpus=2,
        engine_kwargs={"device": "cpu", "enable_prefix_caching": False},
    )
    with Server(tiny_model, str(index), config=config) as s:
        yield s


def test_five_workflows_answer_like_the_single_process_backend(
    ray_server: Server, local_server: Server
) -> None:
    jobs = [(q, n) for q in QUESTIONS for n in sorted(BUILTIN_WORKFLOWS)]

    async def together():
        return await asyncio.gather(*(ray_server.submit(q, small_workflow(n)) for q, n in jobs))

    got = asyncio.run(asyncio.wait_for(together(), timeout=300))
    want = [local_server.run(q, small_workflow(n)) for q, n in jobs]
    assert [r.error for r in got] == [None] * len(jobs)
    assert [r.output for r in got] == [r.output for r in want]
    assert [r.doc_ids for r in got] == [r.doc_ids for r in want]
    assert [_plain(r.state) for r in got] == [_plain(r.state) for r in want]
    workers = ray_server.stats()["workers"]
    assert workers["llm_0"]["tasks"] > 0 and workers["llm_1"]["tasks"] > 0  # both replicas used
    assert workers["shard_0"]["num_scans"] + workers["shard_1"]["num_scans"] > 0


def test_co_scheduling_transforms_work_across_shards_and_stay_exact(
    ray_server: Server, local_server: Server
) -> None:
    """Split sub-stages, similarity reordering (cluster ids asked of the shards) and
    speculation on partial top-k, all over 2 shards: answers equal the plain single-process
    ones."""
    from ragserve.scheduler.cosched import CoScheduleConfig, make_transforms

    jobs = [(q, n) for q in QUESTIONS[:2] for n in ("oneshot", "irg", "multistep")]
    graph = lambda n: get_workflow(n, max_tokens=6, nprobe=4, **EXTRA.get(n, {}))  # noqa: E731
    config = CoScheduleConfig(budget_s=1e-4, spec_first_clusters=1)  # many small sub-stages
    ray_server.set_transforms(make_transforms(config), timeout=60)
    try:

        async def together():
            graphs = [graph(n) for _, n in jobs]
            return await asyncio.gather(
                *(ray_server.submit(q, g) for (q, _), g in zip(jobs, graphs, strict=True))
            )

        got = asyncio.run(asyncio.wait_for(together(), timeout=300))
    finally:
        ray_server.set_transforms((), timeout=60)
    want = [local_server.run(q, graph(n)) for q, n in jobs]
    assert [r.error for r in got] == [None] * len(jobs)
    assert [r.output for r in got] == [r.output for r in want]
    assert [r.doc_ids for r in got] == [r.doc_ids for r in want]
    assert ray_server.stats()["workers"]["shard_1"]["num_scanned_clusters"] > 0


def test_upserts_are_visible_across_shards_then_deleted(ray_server: Server) -> None:
    from ragserve.retrieval import Document

    before = _shard_docs(ray_server)
    doc = Document("atlantis-1", "The capital of Atlantis is Poseidonia.", "Atlantis")
    ray_server.add_documents([doc])
    assert sum(_shard_docs(ray_server)) == sum(before) + 1
    r = ray_server.run("What is the capital of Atlantis?", small_workflow("oneshot"))
    assert r.error is None and r.doc_ids[0] == "atlantis-1"
    assert ray_server.delete_documents(["atlantis-1"]) == 1
    assert _shard_docs(ray_server) == before
    r = ray_server.run("What is the capital of Atlantis?", small_workflow("oneshot"))
    assert "atlantis-1" not in r.doc_ids


def test_stats_and_metrics_carry_per_replica_and_per_shard_labels(ray_server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from ragserve.server.metrics import ServerMetrics

    stats = ray_server.stats()
    assert {"llm_0", "llm_1", "retrieval", "shard_0", "shard_1"} <= set(stats["workers"])
    assert stats["num_blocks_total"] == sum(
        stats["workers"][f"llm_{i}"]["kv_blocks_total"] for i in range(2)
    )
    text = ServerMetrics(ray_server.stats, lambda: 0).render().decode()
    labels = {
        (s.labels.get("worker"), s.labels.get("stat"))
        for f in text_string_to_metric_families(text)
        if f.name == "ragserve:worker_stat"
        for s in f.samples
    }
    assert {("llm_1", "running"), ("shard_1", "num_documents"), ("retrieval", "tasks")} <= labels


def test_killing_a_replica_fails_only_its_requests(ray_server: Server, local_server: Server):
    graph = _long_graph(120)

    async def go():
        jobs = [asyncio.ensure_future(ray_server.submit(f"q{i}", graph)) for i in range(6)]
        await asyncio.to_thread(_wait_busy, ray_server, ("llm_0", "llm_1"))
        ray.kill(ray_server.executor.actors["llm_0"], no_restart=False)
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

    results = asyncio.run(go())
    kinds = [r.error_kind for r in results]
    assert set(kinds) <= {None, "worker_died"} and "worker_died" in kinds and None in kinds
    assert all(len(r.output) > 0 for r in results if r.error is None)
    _next_requests_succeed(ray_server, local_server)
    assert ray_server.stats()["workers"]["llm_0"]["restarts"] == 1


def test_killing_a_shard_retries_only_its_searches(ray_server: Server, local_server: Server):
    async def go():
        jobs = [
            asyncio.ensure_future(ray_server.submit(q, small_workflow("irg")))
            for q in QUESTIONS * 2
        ]
        await asyncio.sleep(0.05)
        ray.kill(ray_server.executor.shards[0], no_restart=False)
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

    results = asyncio.run(go())
    assert {r.error_kind for r in results} <= {None, "worker_died"}, [r.error for r in results]
    _next_requests_succeed(ray_server, local_server)
    assert ray_server.stats()["workers"]["shard_0"]["alive"]


def test_acknowledged_upserts_and_deletes_survive_a_shard_restart(ray_server: Server) -> None:
    """Once ``add_documents`` / ``delete_documents`` return, the owning shard has them in its
    folder: killing that shard actor (Ray restarts it from the folder) loses neither."""
    from ragserve.retrieval import Document
    from ragserve.retrieval.shard_split import read_layout

    layout = read_layout(ray_server.executor._shard_root)
    before = _shard_docs(ray_server)
    kept = Document("lemuria-1", "The capital of Lemuria is Mu City.", "Lemuria")
    gone = Document("lemuria-2", "Lemuria exports coral and pearls.", "Lemuria")
    ray_server.add_documents([kept, gone])
    assert ray_server.delete_documents(["lemuria-2"]) == 1
    owners = [
        ray_server.executor.shards[j]
        for j in {layout.owner_of_document("lemuria-1"), layout.owner_of_document("lemuria-2")}
    ]
    pids = [_pid(shard) for shard in owners]
    for shard in owners:
        ray.kill(shard, no_restart=False)
    for shard, pid in zip(owners, pids, strict=True):
        _wait_restarted(shard, pid)
    after = _shard_docs(ray_server)
    assert sum(after) == sum(before) + 1
    r = ray_server.run("What is the capital of Lemuria?", small_workflow("oneshot"))
    assert r.error is None and r.doc_ids[0] == "lemuria-1"
    assert ray_server.delete_documents(["lemuria-1"]) == 1
    assert _shard_docs(ray_server) == before


@pytest.mark.slow
def test_killing_the_retrieval_coordinator_retries_its_searches_once(
    ray_server: Server, local_server: Server
) -> None:
    async def go():
        jobs = [
            asyncio.ensure_future(ray_server.submit(q, small_workflow("multistep")))
            for q in QUESTIONS * 2
        ]
        await asyncio.sleep(0.05)
        ray.kill(ray_server.executor.actors["retrieval"], no_restart=False)
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

    results = asyncio.run(go())
    assert {r.error_kind for r in results} <= {None, "worker_died"}, [r.error for r in results]
    _next_requests_succeed(ray_server, local_server)
    assert ray_server.stats()["workers"]["retrieval"]["restarts"] == 1


@pytest.mark.slow
def test_a_shard_call_is_retried_once_after_its_actor_restarts(
    ray_server: Server, tmp_path
) -> None:
    from ragserve.runtime.ray_actors import RayShard, ShardDiedError

    @ray.remote(max_restarts=2)
    class Flaky:
        """Dies in ``scan`` the first time (a marker file remembers it across restarts)."""

        def __init__(self, marker: str) -> None:
            self.marker = marker

        def stats(self) -> dict:
            return {}

        def scan(self, x: int) -> int:
            import os
            from pathlib import Path

            if not Path(self.marker).exists():
                Path(self.marker).touch()
                os._exit(1)
            return x + 1

    shard = RayShard(Flaky.remote(str(tmp_path / "died-once")))
    assert shard.call("scan", 41) == 42 and shard.num_retries == 1
    writer = RayShard(Flaky.remote(str(tmp_path / "died-twice")))
    with pytest.raises(ShardDiedError, match="died during scan"):
        writer.call("scan", 1, idempotent=False)  # writes are not retried
    assert writer.call("scan", 1) == 2  # restarted; the marker is there now


def _wait_busy(server: Server, names: tuple[str, ...], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = server.stats()["workers"]
        if all(workers[n].get("running", 0) > 0 for n in names):
            return
        time.sleep(0.02)
    raise AssertionError(f"replicas {names} never all ran a task")


def _next_requests_succeed(server: Server, reference: Server) -> None:
    for q in QUESTIONS:
        got, want = server.run(q, small_workflow("hyde")), reference.run(q, small_workflow("hyde"))
        assert got.error is None and got.output == want.output and got.doc_ids == want.doc_ids


def _wait_restarted(actor, old_pid: int, timeout: float = 120.0) -> None:
    """Wait until ``actor`` answers from a process other than ``old_pid``: ``ray.kill`` is
    asynchronous, so a call made right after it may still reach the instance being killed."""
    deadline = time.monotonic() + timeout
    while _pid(actor, timeout) == old_pid:
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.05)


def _pid(actor, timeout: float = 120.0) -> int:
    """The process id of ``actor``'s current instance (waits for a restart to answer; a call
    that reached the instance being killed is sent again)."""
    import os

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout)
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the actor did not come back"
            time.sleep(0.1)


def _shard_docs(server: Server) -> list[int]:
    workers = server.stats()["workers"]
    return [workers[f"shard_{i}"]["num_documents"] for i in range(2)]


@pytest.mark.parametrize("shards", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_gpu_tier_on_ray_answers_like_the_single_process_backend(
    ray_server: Server,
    local_server: Server,
    tiny_model: str,
    small_index: str,
    tmp_path,
    shards: int,
) -> None:
    """``ServerConfig.gpu_tier`` on the Ray backend (CPU twin: ``device="cpu"``): the tier sits
    in each shard actor (2 shards) or in the coordinator (1 shard), holds only part of the
    lists, and every answer equals the single-process one."""
    from ragserve.runtime.config import GpuTierConfig

    index = tmp_path / "small"
    shutil.copytree(small_index, index)
    chunk = 256 * (384 * 4 + 12)  # one tier chunk of the small index (all-MiniLM, 384-d)
    config = ServerConfig(
        backend="ray",
        num_llm_replicas=1,
        num_index_shards=shards,
        gpu_tier=GpuTierConfig(budget_bytes=2 * shards * chunk, device="cpu"),
        engine_kwargs={"device": "cpu", "enable_prefix_caching": False},
    )
    jobs = [(q, n) for q in QUESTIONS for n in ("oneshot", "irg")]
    with Server(tiny_model, str(index), config=config) as s:
        got = [s.run(q, small_workflow(n)) for q, n in jobs]
        workers = s.stats()["workers"]
    want = [local_server.run(q, small_workflow(n)) for q, n in jobs]
    assert [r.error for r in got] == [None] * len(jobs)
    assert [r.output for r in got] == [r.output for r in want]
    assert [r.doc_ids for r in got] == [r.doc_ids for r in want]
    holders = [f"shard_{j}" for j in range(shards)] if shards > 1 else ["retrieval"]
    assert [workers[h]["tier_clusters"] for h in holders] == [2] * len(holders)  # of 4 lists
