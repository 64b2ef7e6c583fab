"""Node splitting: Eq. 1 budget, cluster packing, and staged search identical to Faiss."""

from __future__ import annotations

import numpy as np
import pytest
from sched_fakes import FakeExecutor

from ragserve.graph import State
from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.staged import (
    StageCostModel,
    expected_gain,
    optimal_budget,
    pack_clusters,
)
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import (
    RequestState,
    RetrievalResult,
    RetrievalTask,
    Scheduler,
    Wavefront,
)
from ragserve.scheduler.cosched import SplitTransform
from ragserve.scheduler.messages import (
    RetrievalPartial,
    StagedRetrievalResult,
    StagedRetrievalTask,
)
from ragserve.workflows import get_workflow

DIM = 16


class TableEmbedder:
    """Queries are keys of a table of vectors (no model)."""

    name = "table"

    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table
        self.dim = DIM

    def encode(self, texts, *, is_query: bool = True, progress: bool = False) -> np.ndarray:
        return np.stack([self.table[t] for t in texts]).astype(np.float32)


def make_index(kind: str, metric: str, n: int = 3000, nlist: int = 32) -> VectorIndex:
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(nlist, DIM))
    x = centers[rng.integers(0, nlist, n)] + 0.3 * rng.normal(size=(n, DIM))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    docs = [Document(f"d{i}", f"text {i}", f"T{i}") for i in range(n)]
    extra = {"pq_nbits": 4} if kind == "ivf_pq" else {}
    return VectorIndex.from_vectors(
        docs, x, embedder_name="table", nlist=nlist, kind=kind, metric=metric, **extra
    )


def doc_ids(index: VectorIndex, faiss_ids) -> list[str]:
    return [d.id for d in index.get_documents([int(i) for i in faiss_ids if i >= 0])]


def test_optimal_budget_is_the_argmax_of_eq1() -> None:
    t_r, beta = 0.2, 0.002
    mb = optimal_budget(t_r, beta)
    grid = np.linspace(1e-4, t_r, 20001)
    best = grid[np.argmax([expected_gain(g, t_r, beta) for g in grid])]
    assert mb == pytest.approx(np.sqrt(2 * t_r * beta))
    assert mb == pytest.approx(best, rel=1e-3)
    assert optimal_budget(0.01, 0.01) is None  # t_R <= 2 beta: splitting never pays
    assert optimal_budget(0.2, 0.0) is None


def test_budget_survives_a_stage_mean_decayed_to_zero() -> None:
    # every probed list resident on the GPU tier: the CPU part of each stage scans 0 vectors,
    # the moving average decays until 2 t_R beta underflows (found on the H200: ValueError
    # "mb must be > 0" failed every request after ~3,000 stages)
    from ragserve.retrieval.staged import StageCostModel

    cost = StageCostModel(beta=1e-5)
    cost.observe_stage(10_000)
    assert cost.budget() is not None
    for _ in range(4000):
        cost.observe_stage(0)
    assert 0.0 <= cost.mean_stage_seconds < 1e-300
    assert cost.budget() is None
    assert optimal_budget(5e-324, 1e-6) is None


def test_pack_clusters_fills_the_budget_and_takes_at_least_one() -> None:
    assert pack_clusters([0.4, 0.3, 0.5, 0.2], 1.0) == 3
    assert pack_clusters([0.4, 0.3, 0.5, 0.2], 5.0) == 4
    assert pack_clusters([2.0, 0.1], 1.0) == 1
    assert pack_clusters([], 1.0) == 0


def test_cost_model_budget_from_measurements() -> None:
    cost = StageCostModel()
    assert cost.budget() is None  # nothing measured yet: no split
    cost.observe_scan(1_000_000, 0.1)
    cost.observe_stage(2_000_000)
    cost.observe_overhead(0.001)
    assert cost.seconds_per_vector == pytest.approx(1e-7)
    assert cost.budget() == pytest.approx(np.sqrt(2 * 0.2 * 0.001))
    assert cost.budget(0.05) == 0.05


def test_split_transform_marks_retrievals() -> None:
    wf = Wavefront(retrieval=[RetrievalTask("t", "q", 3, 8)])
    out = SplitTransform(budget_s=0.01).apply(wf).retrieval[0]
    assert isinstance(out, StagedRetrievalTask) and out.split and out.budget_s == 0.01
    assert (out.task_id, out.query, out.topk, out.nprobe) == ("t", "q", 3, 8)


def _drive(runner: StagedRetrievalRunner, arrivals: dict[int, list]) -> tuple[dict, dict]:
    """Call ``run`` step by step, adding ``arrivals[step]``; collect finals and partials."""
    finals, partials = {}, {}
    step = 0
    while step <= max(arrivals) or runner.has_pending():
        updates = runner.run(arrivals.get(step, []))
        for u in updates:
            if isinstance(u, RetrievalPartial):
                partials.setdefault(u.task_id, []).append(u)
            else:
                finals[u.task_id] = u
        step += 1
        assert step < 10_000
    return finals, partials


@pytest.mark.parametrize(
    ("kind", "metric"),
    [("ivf_flat", "ip"), ("ivf_sq8", "l2"), pytest.param("ivf_pq", "ip", marks=pytest.mark.slow)],
)
def test_staged_search_equals_faiss(kind: str, metric: str) -> None:
    index = make_index(kind, metric)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(12, DIM)).astype(np.float32)
    emb = TableEmbedder({f"q{i}": q[i] for i in range(len(q))})
    runner = StagedRetrievalRunner(index, emb)
    runner.search.cost.seconds_per_vector = 1.0  # cost = list size: the budget counts vectors
    runner.search.cost.observe_scan = lambda *args: None  # keep it so (no timing in the test)
    nprobe, topk = 12, 5
    arrivals: dict[int, list] = {}
    for i in range(len(q)):
        hit = tuple(int(c) for c in rng.choice(32, 3, replace=False))
        prev = tuple(int(c) for c in rng.choice(32, 8, replace=False))
        task = StagedRetrievalTask(
            f"t{i}",
            f"q{i}",
            topk,
            nprobe,
            split=True,
            budget_s=float(rng.integers(50, 400)),
            hit_clusters=hit,
            previous_clusters=prev,
            cache_topk=20 if i % 2 else 0,
            emit_partials=True,
        )
        arrivals.setdefault(int(i // 3) * 2, []).append(task)  # later tasks join mid-way
    finals, partials = _drive(runner, arrivals)
    want = index.faiss_index
    want.nprobe = nprobe
    _, faiss_ids = want.search(q, topk)
    for i in range(len(q)):
        r = finals[f"t{i}"]
        assert isinstance(r, StagedRetrievalResult) and r.error is None
        assert [p.doc_id for p in r.passages] == doc_ids(index, faiss_ids[i])
        assert r.num_substages > 1 and len(partials[f"t{i}"]) == r.num_substages - 1
        assert len(r.probed_clusters) == nprobe
        if i % 2:
            assert r.hit_clusters and set(r.hit_clusters) <= set(r.probed_clusters)
    assert runner.search.num_steps > 3


def test_unsplit_staged_task_is_one_substage_and_plain_tasks_still_work() -> None:
    index = make_index("ivf_flat", "ip")
    q = np.random.default_rng(2).normal(size=(2, DIM)).astype(np.float32)
    runner = StagedRetrievalRunner(index, TableEmbedder({"a": q[0], "b": q[1]}))
    staged = StagedRetrievalTask("s", "a", 4, 16)
    updates = runner.run([staged, RetrievalTask("p", "b", 4, 16)])
    by_id = {u.task_id: u for u in updates}
    assert not runner.has_pending()
    assert by_id["s"].num_substages == 1
    assert isinstance(by_id["p"], RetrievalResult)
    want = index.search(q, 4, nprobe=16).ids
    assert [p.doc_id for p in by_id["s"].passages] == doc_ids(index, want[0])
    assert [p.doc_id for p in by_id["p"].passages] == doc_ids(index, want[1])


def test_first_clusters_gives_an_early_partial() -> None:
    index = make_index("ivf_flat", "ip")
    q = np.random.default_rng(3).normal(size=(1, DIM)).astype(np.float32)
    runner = StagedRetrievalRunner(index, TableEmbedder({"a": q[0]}))
    task = StagedRetrievalTask("s", "a", 3, 16, first_clusters=2, emit_partials=True)
    finals, partials = _drive(runner, {0: [task]})
    assert [p.num_substages for p in partials["s"]] == [1]
    assert finals["s"].num_substages == 2


def test_admission_error_fails_only_those_tasks() -> None:
    index = make_index("ivf_flat", "ip", n=500, nlist=8)
    q = np.random.default_rng(4).normal(size=(1, DIM)).astype(np.float32)
    runner = StagedRetrievalRunner(index, TableEmbedder({"a": q[0]}))
    updates = runner.run([StagedRetrievalTask("bad", "missing", 3, 4)])
    assert updates[0].error and "KeyError" in updates[0].error
    updates = runner.run([StagedRetrievalTask("ok", "a", 3, 4)])
    assert updates[0].error is None and len(updates[0].passages) == 3


class HashEmbedder:
    """Text -> unit vector: a topic from the first line, noise from the whole text (seeded)."""

    name = "hash"
    dim = DIM

    def __init__(self, noise: float = 0.3) -> None:
        self.noise = noise

    def encode(self, texts, *, is_query: bool = True, progress: bool = False) -> np.ndarray:
        import zlib

        out = []
        for t in texts:
            topic = np.random.default_rng(zlib.crc32(t.split("\n")[0].encode())).normal(size=DIM)
            jitter = np.random.default_rng(zlib.crc32(t.encode())).normal(size=DIM)
            v = topic + self.noise * jitter
            out.append(v / np.linalg.norm(v))
        return np.stack(out).astype(np.float32)


class StagedExecutor(FakeExecutor):
    """The scheduler tests' fake generation with a real ``StagedRetrievalRunner``."""

    def __init__(self, runner: StagedRetrievalRunner) -> None:
        super().__init__()
        self.runner = runner
        self._queued: list = []

    def submit_retrieval(self, tasks: list) -> None:
        self.retrieval_calls.append(list(tasks))
        self._queued.extend(tasks)

    def poll(self, timeout: float) -> list:
        updates: list = []
        if self._queued or self.runner.has_pending():
            tasks, self._queued = self._queued, []
            updates.extend(self.runner.run(tasks))
        return updates + super().poll(timeout)


def run_requests(scheduler: Scheduler, requests: list[tuple[str, object, str]]) -> dict:
    done: dict = {}
    for rid, graph, question in requests:
        req = RequestState(rid, graph, State(input=question), on_done=None)
        req.on_done = lambda r, done=done: done.__setitem__(r.request_id, r)
        scheduler.add_request(req)
    for _ in range(5000):
        scheduler.step()
        if not scheduler.has_unfinished():
            return done
    raise AssertionError("scheduler did not finish")


def test_split_through_the_scheduler_equals_faiss() -> None:
    index = make_index("ivf_flat", "ip")
    runner = StagedRetrievalRunner(index, HashEmbedder(), default_nprobe=16)
    runner.search.cost.seconds_per_vector = 1.0
    runner.search.cost.observe_scan = lambda *args: None
    ex = StagedExecutor(runner)
    sched = Scheduler(ex, [SplitTransform(budget_s=150.0)])
    graph = get_workflow("irg", rounds=2, topk=3)
    done = run_requests(sched, [(f"r{i}", graph, f"question {i}") for i in range(6)])
    queries = [t.query for call in ex.retrieval_calls for t in call]
    assert len(queries) == 12 and all(r.error is None for r in done.values())
    want = index.search(HashEmbedder().encode(queries), 3, nprobe=16).ids
    got = {}
    for r in done.values():
        for p in r.state["docs"]:
            got.setdefault(r.request_id, []).append(p.doc_id)
    final_rows = {q: i for i, q in enumerate(queries)}
    for r in done.values():  # the last retrieval's docs are in state["docs"]
        last = [q for q in queries if q.startswith(r.state["input"] + "\n")][-1]
        assert got[r.request_id] == doc_ids(index, want[final_rows[last]])
