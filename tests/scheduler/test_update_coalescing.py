"""Update coalescing (``Scheduler(enable_update_coalescing=True)``): a generation task nobody
reads mid-way goes out with ``chunk_s = inf``; a stream listener, a transform that
``needs_partial_updates`` or a task's own ``chunk_s`` keeps it as it was; outputs equal the
uncoalesced run's (the oracle)."""

from __future__ import annotations

import math

import pytest
from sched_fakes import FakeExecutor

from ragserve.graph import State
from ragserve.scheduler import BaseTransform, RequestState, Scheduler, Wavefront
from ragserve.scheduler.cosched import SplitTransform
from ragserve.workflows import get_workflow

WORKFLOWS = ("oneshot", "hyde", "multistep", "irg", "recomp")


class _WatchesPartialText(BaseTransform):
    needs_partial_updates = True

    def apply(self, wavefront: Wavefront) -> Wavefront:
        return wavefront


def _run(scheduler: Scheduler, on_delta=None) -> tuple[dict, list]:
    done: dict = {}
    for i, name in enumerate(WORKFLOWS):
        scheduler.add_request(
            RequestState(
                f"r{i}",
                get_workflow(name),
                State(input=f"question {i}"),
                on_done=lambda r: done.__setitem__(r.request_id, r),
                on_delta=on_delta,
            )
        )
    for _ in range(400):
        scheduler.step()
        if not scheduler.has_unfinished():
            break
    else:
        raise AssertionError("scheduler did not finish")
    chunks = [t.chunk_s for call in scheduler.executor.generation_calls for t in call]
    return {rid: (r.output, r.error, r.doc_ids) for rid, r in done.items()}, chunks


def test_unwatched_generations_are_coalesced_with_the_same_outputs() -> None:
    oracle, plain = _run(Scheduler(FakeExecutor()))
    got, chunks = _run(Scheduler(FakeExecutor(), enable_update_coalescing=True))
    assert got == oracle and len(got) == len(WORKFLOWS)
    assert plain and all(c is None for c in plain)
    assert len(chunks) == len(plain) and all(c == math.inf for c in chunks)


@pytest.mark.parametrize("watcher", ["stream", "transform"])
def test_a_reader_of_partial_text_keeps_per_step_updates(watcher: str) -> None:
    transforms = [_WatchesPartialText()] if watcher == "transform" else []
    deltas: list[str] = []
    scheduler = Scheduler(FakeExecutor(), transforms, enable_update_coalescing=True)
    _, chunks = _run(scheduler, on_delta=deltas.append if watcher == "stream" else None)
    assert chunks and all(c is None for c in chunks)


def test_coalescing_is_set_before_the_transforms_and_kept_by_the_split() -> None:
    split = SplitTransform(budget_s=0.01)
    _, chunks = _run(Scheduler(FakeExecutor(), [split], enable_update_coalescing=True))
    assert chunks and all(c == math.inf for c in chunks)
    _, chunks = _run(Scheduler(FakeExecutor(), [SplitTransform(budget_s=0.01)]))
    assert chunks and all(c == 0.01 for c in chunks)
