"""The benchmark's baseline systems (``bench/rag_systems.py``) hold work back as they claim."""

from __future__ import annotations

import sys
from pathlib import Path

from sched_fakes import FakeExecutor

from ragserve.graph import State
from ragserve.scheduler import GenerationUpdate, RequestState, RetrievalResult, Scheduler
from ragserve.workflows import get_workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from rag_systems import SerialStagesTransform, StagewiseTransform  # noqa: E402

sys.path.pop(0)


class _Tracking(FakeExecutor):
    """Records, at every submission, what of the other kind is still in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = {"gen": set(), "ret": set()}
        self.overlaps: list[str] = []
        self.max_in_flight = {"gen": 0, "ret": 0}

    def _submit(self, kind: str, tasks) -> None:
        other = "ret" if kind == "gen" else "gen"
        if self.in_flight[other]:
            self.overlaps.append(kind)
        self.in_flight[kind] |= {t.task_id for t in tasks}
        self.max_in_flight[kind] = max(self.max_in_flight[kind], len(self.in_flight[kind]))

    def submit_generation(self, tasks) -> None:
        self._submit("gen", tasks)
        super().submit_generation(tasks)

    def submit_retrieval(self, tasks) -> None:
        self._submit("ret", tasks)
        super().submit_retrieval(tasks)

    def poll(self, timeout: float) -> list:
        updates = super().poll(timeout)
        for u in updates:
            if isinstance(u, RetrievalResult):
                self.in_flight["ret"].discard(u.task_id)
            elif isinstance(u, GenerationUpdate) and u.finished:
                self.in_flight["gen"].discard(u.task_id)
        return updates


def _run(transform) -> tuple[_Tracking, dict]:
    ex = _Tracking()
    sched = Scheduler(ex, [transform])
    done: dict = {}
    for i in range(6):
        graph = get_workflow("irg" if i % 2 else "oneshot", topk=2)
        req = RequestState(f"r{i}", graph, State(input=f"question {i}"), on_done=None)
        req.on_done = lambda r: done.__setitem__(r.request_id, r)
        sched.add_request(req)
    for _ in range(500):
        sched.step()
        if not sched.has_unfinished():
            break
    return ex, done


def test_stagewise_never_overlaps_generation_and_retrieval_but_batches() -> None:
    ex, done = _run(StagewiseTransform())
    assert len(done) == 6 and all(r.error is None for r in done.values())
    assert ex.overlaps == []
    assert ex.max_in_flight["ret"] >= 3 and ex.max_in_flight["gen"] >= 3  # whole batches


def test_sequential_runs_one_task_of_each_kind_at_a_time() -> None:
    ex, done = _run(SerialStagesTransform())
    assert len(done) == 6 and all(r.error is None for r in done.values())
    assert ex.max_in_flight == {"gen": 1, "ret": 1}
    assert ex.overlaps  # a retrieval and a generation do run side by side
