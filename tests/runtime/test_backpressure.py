"""Bounded queues: a flood of submissions to a worker that takes nothing fills its inbox and
the server's pending queue up to their bounds, and everything past them fails at once as
``overloaded`` (HTTP 429) instead of growing; once the worker runs again, every accepted task
completes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ragserve.runtime import ServerConfig
from ragserve.runtime.errors import WorkerError
from ragserve.runtime.executors import ProcessExecutor
from ragserve.runtime.workers import WorkerSpec
from ragserve.scheduler import RetrievalTask


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "T"


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_flood_is_bounded_and_the_rest_is_overloaded(tiny_model: str, small_index: str) -> None:
    config = ServerConfig(queue_size=2, max_pending_messages=3)
    gen = WorkerSpec(
        "generation", model=tiny_model, config=ServerConfig(engine_kwargs={"device": "cpu"})
    )
    executor = ProcessExecutor(gen, WorkerSpec("retrieval", index=small_index), config)
    worker = executor.workers["ret"]
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not _stopped(worker.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(20):
            executor.submit_retrieval([RetrievalTask(f"t{i}", "the capital of Peru", 1)])
        assert len(worker.pending) == 3  # 2 in the inbox, 3 waiting, the rest refused
        refused = executor.poll(0.0)
        assert sorted(u.task_id for u in refused) == sorted(f"t{i}" for i in range(5, 20))
        assert all(u.error_kind == "overloaded" and "queue is full" in u.error for u in refused)
        with pytest.raises(WorkerError, match="queue is full") as info:
            executor.call_retrieval("embed", ["x"]).result(timeout=1.0)
        assert info.value.kind == "overloaded"
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    try:
        done = {}
        deadline = time.monotonic() + 120
        while len(done) < 5 and time.monotonic() < deadline:
            done.update({u.task_id: u for u in executor.poll(0.1)})
        assert sorted(done) == sorted(f"t{i}" for i in range(5))
        assert all(r.error is None and r.passages[0].doc_id == "Peru-1" for r in done.values())
        assert worker.pending == type(worker.pending)() and not worker.in_flight
    finally:
        executor.close()
