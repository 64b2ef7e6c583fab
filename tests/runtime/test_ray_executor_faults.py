"""``RayExecutor``'s fault bookkeeping with fake actors (no Ray cluster): a dead replica
fails only its tasks and gets no new ones until it answers; a dead coordinator's retrievals
are held, resent once when it is back, failed on a second loss or when it never returns."""

from __future__ import annotations

import time

from ragserve.runtime import ServerConfig
from ragserve.runtime.ray_backend import RETRIEVAL, RayExecutor
from ragserve.scheduler import GenerationParams, GenerationTask, RetrievalTask


class _Method:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)


class _FakeActor:
    def __init__(self) -> None:
        self.submit, self.abort, self.poll = _Method(), _Method(), _Method()


def _executor(**config) -> RayExecutor:
    ex = RayExecutor.__new__(RayExecutor)
    ex._init_state(ServerConfig(backend="ray", num_llm_replicas=2, **config))
    ex.actors = {RETRIEVAL: _FakeActor(), "llm_0": _FakeActor(), "llm_1": _FakeActor()}
    return ex


def _gen(task_id: str, prompt: str) -> GenerationTask:
    return GenerationTask(task_id, prompt, GenerationParams())


def test_a_dead_replica_fails_only_its_tasks_and_is_skipped_until_back() -> None:
    ex = _executor()
    home = ex.router.preferred("docs A")
    ex.submit_generation([_gen("a", "docs A"), _gen("b", "docs A")])
    other = _gen("c", "docs C")
    ex.submit_generation([other])
    dead = f"llm_{home}"
    updates = ex._on_death(dead, RuntimeError("killed"))
    lost = {"a", "b"} | ({"c"} if ex.router.preferred("docs C") == home else set())
    assert {u.task_id for u in updates} == lost
    assert all(u.finished and u.error_kind == "worker_died" for u in updates)
    assert sorted(ex.actors[dead].abort.calls[0][0]) == sorted(lost)  # raced submits
    ex.submit_generation([_gen("d", "docs A")])  # its home is down: the other replica
    assert ex.router.replica_of("d") == 1 - home
    assert ex._on_death(dead, RuntimeError("still restarting")) == []  # nothing new lost
    assert ex._restarts[dead] == 1
    ex._on_back(dead)
    ex.submit_generation([_gen("e", "docs A")])
    assert ex.router.replica_of("e") == home


def test_a_dead_coordinator_resends_its_retrievals_once() -> None:
    ex = _executor()
    coordinator = ex.actors[RETRIEVAL]
    ex.submit_retrieval([RetrievalTask("r1", "q1", 2), RetrievalTask("r2", "q2", 2)])
    assert ex._on_death(RETRIEVAL, RuntimeError("killed")) == []  # held for one retry
    ex.submit_retrieval([RetrievalTask("r3", "q3", 2)])  # held too while it is down
    assert len(coordinator.submit.calls) == 1
    ex._on_back(RETRIEVAL)
    assert [t.task_id for t in coordinator.submit.calls[1][0]] == ["r1", "r2", "r3"]
    failed = ex._on_death(RETRIEVAL, RuntimeError("killed again"))
    assert {u.task_id for u in failed} == {"r1", "r2"}  # their retry is spent
    assert all(u.error_kind == "worker_died" for u in failed)
    assert [t.task_id for t in ex._held] == ["r3"]  # r3 had not used its retry


def test_a_coordinator_that_never_returns_fails_what_waits_for_it() -> None:
    ex = _executor(worker_start_timeout=0.01)
    ex.submit_retrieval([RetrievalTask("r1", "q1", 2)])
    # NOTE: on a loaded machine 0.01 s can pass inside _on_death: then it fails r1 itself
    early = ex._on_death(RETRIEVAL, RuntimeError("killed"))
    time.sleep(0.02)
    ex.submit_retrieval([RetrievalTask("r2", "q2", 2)])
    failed = [*early, *ex.poll(0.0)]
    assert {u.task_id for u in failed} == {"r1", "r2"}
    assert all("did not come back" in u.error for u in failed)
    assert ex._held == [] and ex._retrievals == {}
