"""Node splitting, generation side: ``SplitTransform`` gives generation tasks the chunk ``mb``
(fixed ``budget_s``, or learned from split retrieval results) and the switch turns it off."""

from __future__ import annotations

import pytest
from test_split import HashEmbedder, StagedExecutor, make_index, run_requests

from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import (
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
    Scheduler,
    Wavefront,
)
from ragserve.scheduler.cosched import CoScheduleConfig, SplitTransform, make_transforms
from ragserve.scheduler.messages import RetrievalPartial, StagedRetrievalResult
from ragserve.workflows import get_workflow


def gen(task_id: str, chunk_s: float | None = None) -> GenerationTask:
    return GenerationTask(task_id, "p", GenerationParams(max_tokens=4), chunk_s=chunk_s)


def cycle(split: SplitTransform, retrieval_ids=(), generation=()) -> Wavefront:
    wf = Wavefront(
        generation=list(generation), retrieval=[RetrievalTask(t, "q", 3) for t in retrieval_ids]
    )
    return split.apply(wf)


def staged(task_id: str, num_substages: int, scan_seconds: float, error=None):
    return StagedRetrievalResult(
        task_id, (), error, num_substages=num_substages, scan_seconds=scan_seconds
    )


def test_fixed_budget_is_the_chunk_and_an_explicit_chunk_is_kept() -> None:
    split = SplitTransform(budget_s=0.02)
    wf = cycle(split, ["r"], [gen("a"), gen("b", chunk_s=0.5)])
    assert [t.chunk_s for t in wf.generation] == [0.02, 0.5]
    assert wf.retrieval[0].split and wf.retrieval[0].budget_s == 0.02
    assert [t.task_id for t in wf.generation] == ["a", "b"]
    assert wf.generation[0].prompt == "p" and wf.generation[0].params.max_tokens == 4


def test_switch_off_leaves_per_token_updates() -> None:
    split = SplitTransform(budget_s=0.02, gen_chunks=False)
    assert split.chunk_s is None
    assert cycle(split, ["r"], [gen("a")]).generation[0].chunk_s is None
    (off,) = make_transforms(CoScheduleConfig(enable_gen_chunks=False, **_only_split()))
    (on,) = make_transforms(CoScheduleConfig(budget_s=0.01, **_only_split()))
    assert isinstance(off, SplitTransform) and not off.gen_chunks
    assert isinstance(on, SplitTransform) and on.gen_chunks and on.chunk_s == 0.01
    assert CoScheduleConfig().enable_gen_chunks  # on by default, with enable_split


def _only_split() -> dict:
    return {"enable_similarity": False, "enable_speculation": False}


def test_eq1_budget_is_learned_from_split_results() -> None:
    split = SplitTransform(budget_s=None, alpha=0.5)
    assert cycle(split, ["r1", "r2", "r3"], [gen("a")]).generation[0].chunk_s is None
    updates = [
        RetrievalPartial("r1", (), 1),  # not final: ignored
        staged("r1", 1, 0.9),  # one sub-stage: not cut, says nothing about mb
        staged("other", 4, 0.4),  # not a task this transform split
        RetrievalResult("r2", (), "boom"),
        GenerationUpdate("a", "x", (1,), False),
    ]
    assert split.on_updates(updates) == updates  # passed through unchanged
    assert split.learned_budget_s is None
    assert cycle(split, [], [gen("b")]).generation[0].chunk_s is None  # still unknown
    split.on_updates([staged("r3", 4, 0.08)])
    assert split.learned_budget_s == pytest.approx(0.02)
    assert cycle(split, ["r4"], [gen("c")]).generation[0].chunk_s == pytest.approx(0.02)
    split.on_updates([staged("r4", 2, 0.08)])  # 0.04 per sub-stage, averaged in
    assert split.learned_budget_s == pytest.approx(0.03)
    split.on_updates([staged("r4", 2, 1.0)])  # its result came already: ignored
    assert split.learned_budget_s == pytest.approx(0.03)
    assert split._split_ids == set()  # every marked task's final result seen


def test_learned_budget_never_overrides_a_fixed_one() -> None:
    split = SplitTransform(budget_s=0.05)
    cycle(split, ["r"])
    split.on_updates([staged("r", 5, 0.05)])
    assert cycle(split, [], [gen("a")]).generation[0].chunk_s == 0.05


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_s"):
        gen("a", chunk_s=0.0)
    with pytest.raises(ValueError, match="alpha"):
        SplitTransform(alpha=0.0)
    with pytest.raises(ValueError, match="budget_s"):
        SplitTransform(budget_s=-1.0)


def test_learned_chunk_reaches_generation_tasks_through_the_chain() -> None:
    """Eq. 1 path end to end: the worker cuts retrievals (its budget pinned to 60 vectors, in
    cost units), the chain's ``SplitTransform`` learns ``mb`` from the results, and the
    generation tasks dispatched after them carry it; outputs equal the unsplit run."""

    def run(transforms):
        runner = StagedRetrievalRunner(make_index("ivf_flat", "ip"), HashEmbedder(), 16)
        runner.search.cost.seconds_per_vector = 1.0
        runner.search.cost.observe_scan = lambda *args: None
        runner.search.cost.budget = lambda override=None: 60.0 if override is None else override
        ex = StagedExecutor(runner)
        graph = get_workflow("oneshot", topk=3)
        done = run_requests(
            Scheduler(ex, transforms), [(f"r{i}", graph, f"q {i}") for i in range(6)]
        )
        return done, ex

    plain, _ = run([])
    transforms = make_transforms(CoScheduleConfig(enable_speculation=False))
    split = transforms[0]
    chunked, ex = run(list(transforms))
    assert {r: d.output for r, d in chunked.items()} == {r: d.output for r, d in plain.items()}
    assert isinstance(split, SplitTransform) and split.budget_s is None
    assert split.learned_budget_s is not None and split.learned_budget_s > 0
    tasks = [t for call in ex.generation_calls for t in call]
    assert len(tasks) == 6 and all(t.chunk_s is not None and t.chunk_s > 0 for t in tasks)
    assert all(t.split and t.budget_s is None for c in ex.retrieval_calls for t in c)
