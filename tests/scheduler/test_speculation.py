"""Speculative generation: adopted when the final top-k equals the partial, aborted otherwise;
outputs always equal the non-speculative run."""

from __future__ import annotations

import math
import zlib

import pytest
from test_split import HashEmbedder, StagedExecutor, make_index, run_requests

from ragserve.graph import State
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import RequestState, Scheduler
from ragserve.scheduler.cosched import (
    CoScheduleConfig,
    SimilarityTransform,
    SpeculationTransform,
    SpeculativeRetrievalTransform,
    SplitTransform,
    make_transforms,
)
from ragserve.workflows import get_workflow


class PromptExecutor(StagedExecutor):
    """Fake generation whose text is a hash of the whole prompt (docs change the output)."""

    def __init__(self, runner: StagedRetrievalRunner) -> None:
        super().__init__(runner)
        self.submitted: list[str] = []
        self.chunks: dict[str, float | None] = {}  # task id -> its chunk_s

    def submit_generation(self, tasks: list) -> None:
        super().submit_generation(tasks)
        for t in tasks:
            self.submitted.append(t.task_id)
            self.chunks[t.task_id] = t.chunk_s
            self._running[t.task_id] = (f"g{zlib.crc32(t.prompt.encode()):08x}", 0)


def _run(transforms: list, workflow: str, n: int = 8, **scheduler_kwargs):
    index = make_index("ivf_flat", "ip")
    runner = StagedRetrievalRunner(index, HashEmbedder(), default_nprobe=16)
    runner.search.cost.seconds_per_vector = 1.0
    runner.search.cost.observe_scan = lambda *args: None
    ex = PromptExecutor(runner)
    graph = get_workflow(workflow, topk=3, **({"rounds": 2} if workflow == "irg" else {}))
    scheduler = Scheduler(ex, transforms, **scheduler_kwargs)
    done = run_requests(scheduler, [(f"r{i}", graph, f"q {i}") for i in range(n)])
    return done, ex


def test_speculative_generations_are_coalesced_like_their_requests_tasks() -> None:
    """Under ``enable_update_coalescing`` a speculative generation (a side task) of a request
    nobody streams reports first token and end only (``chunk_s = inf``), as the request's own
    generation would; outputs equal the uncoalesced run's."""
    plain, ex_plain = _run([SpeculationTransform(capacity=1000, first_clusters=1)], "oneshot")
    spec = SpeculationTransform(capacity=1000, first_clusters=1)
    fast, ex = _run([spec], "oneshot", enable_update_coalescing=True)
    assert {r: d.output for r, d in fast.items()} == {r: d.output for r, d in plain.items()}
    assert spec.stats.num_adopted > 0 and all(d.error is None for d in fast.values())
    started = [t for t in ex.submitted if t.startswith("spec/")]
    assert started and all(ex.chunks[t] == math.inf for t in started)
    assert all(c is None for t, c in ex_plain.chunks.items() if t.startswith("spec/"))
    assert all(ex.chunks[t] == math.inf for t in ex.submitted)


def test_a_streamed_requests_speculation_keeps_per_step_updates() -> None:
    index = make_index("ivf_flat", "ip")
    runner = StagedRetrievalRunner(index, HashEmbedder(), default_nprobe=16)
    ex = PromptExecutor(runner)
    spec = SpeculationTransform(capacity=1000, first_clusters=1)
    scheduler = Scheduler(ex, [spec], enable_update_coalescing=True)
    graph = get_workflow("oneshot", topk=3)
    for i in range(4):
        scheduler.add_request(
            RequestState(f"r{i}", graph, State(input=f"q {i}"), None, on_delta=lambda d: None)
        )
    for _ in range(5000):
        scheduler.step()
        if not scheduler.has_unfinished():
            break
    started = [t for t in ex.submitted if t.startswith("spec/")]
    assert started and all(ex.chunks[t] is None for t in started)


@pytest.mark.parametrize("workflow", ["oneshot", "irg"])
def test_speculative_outputs_equal_plain_outputs(workflow: str) -> None:
    plain, _ = _run([], workflow)
    spec = SpeculationTransform(capacity=1000, max_restarts=2)
    fast, ex = _run([SplitTransform(budget_s=100.0), SimilarityTransform(), spec], workflow)
    assert {r: d.output for r, d in fast.items()} == {r: d.output for r, d in plain.items()}
    assert all(d.error is None for d in fast.values())
    s = spec.stats
    assert s.num_started > 0 and s.num_adopted > 0
    assert s.num_confirmed + s.num_wrong <= s.num_started
    assert s.num_adopted == s.num_confirmed  # every confirmed speculation was taken
    started = [t for t in ex.submitted if t.startswith("spec/")]
    assert set(ex.aborted) <= set(started)
    assert len(set(ex.aborted)) == s.num_aborted - _never_dispatched(s, started)
    # an adopted speculation replaces the real task: fewer real answer tasks were submitted
    real = [t for t in ex.submitted if not t.startswith("spec/")]
    gen_nodes = sum(k == "generation" for d in fast.values() for k in _kinds(d))
    assert len(real) == gen_nodes - s.num_adopted
    assert spec.num_in_flight == 0


def _kinds(response) -> list[str]:
    return [t.kind for t in response.node_timings]


def _never_dispatched(stats, started: list[str]) -> int:
    return stats.num_started - len(started)


def test_wrong_partials_are_aborted_and_restarted() -> None:
    """A first sub-stage of one cluster is often not the final top-k: those abort."""
    spec = SpeculationTransform(capacity=1000, first_clusters=1, max_restarts=0)
    plain, _ = _run([], "oneshot", n=12)
    fast, ex = _run([spec], "oneshot", n=12)
    assert {r: d.output for r, d in fast.items()} == {r: d.output for r, d in plain.items()}
    s = spec.stats
    assert s.num_started == 12 and s.num_wrong > 0 and s.num_confirmed > 0
    assert s.num_wrong + s.num_confirmed == 12 and s.accuracy == s.num_confirmed / 12
    assert len(ex.aborted) == s.num_wrong


def test_no_speculation_when_generation_is_busy() -> None:
    idle_only = SpeculationTransform(capacity=1, tau=1e-9, first_clusters=1)
    _, ex = _run([idle_only], "oneshot", n=4)  # 0 / 1 < tau only with nothing in flight
    assert idle_only.stats.num_started <= 1
    never = SpeculationTransform(capacity=1, tau=0.0, first_clusters=1)
    _, ex = _run([never], "oneshot", n=4)
    assert never.stats.num_started == 0 and not any(t.startswith("spec/") for t in ex.submitted)


def test_speculative_retrieval_warms_the_cache_and_keeps_outputs() -> None:
    def run(transforms: list):
        index = make_index("ivf_flat", "ip")
        runner = StagedRetrievalRunner(index, HashEmbedder(), default_nprobe=16)
        ex = PromptExecutor(runner)
        graph = get_workflow("hyde", topk=3, hypo_tokens=2)
        requests = [(f"r{i}", graph, f"q {i}") for i in range(5)]
        return run_requests(Scheduler(ex, transforms), requests), ex

    plain, _ = run([])
    cfg = CoScheduleConfig(enable_split=False, enable_speculation=False, enable_spec_retrieval=True)
    transforms = make_transforms(cfg)
    sim, specret = transforms
    assert isinstance(specret, SpeculativeRetrievalTransform)
    fast, ex = run(list(transforms))
    assert {r: d.output for r, d in fast.items()} == {r: d.output for r, d in plain.items()}
    assert specret.num_issued == 5 and specret.num_warmed == 5
    real = [t for call in ex.retrieval_calls for t in call if not t.task_id.startswith("specret/")]
    # hyde's only real retrieval had no earlier retrieval: its cache came from the speculation
    assert len(real) == 5 and all(t.hit_clusters and t.previous_clusters for t in real)
    assert sim.num_reordered == 5


def test_spec_retrieval_needs_similarity() -> None:
    with pytest.raises(ValueError, match="similarity"):
        CoScheduleConfig(enable_similarity=False, enable_spec_retrieval=True)
