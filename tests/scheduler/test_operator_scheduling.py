"""Operator nodes and fan-out/join through the scheduler (fake executor, real CPU pool)."""

from __future__ import annotations

import threading
import time

import pytest
from sched_fakes import FakeExecutor

from ragserve.graph import END, START, RAGraph, State
from ragserve.scheduler import (
    EmbedTask,
    GenerationParams,
    OperatorConfig,
    OperatorResult,
    RequestState,
    RerankTask,
    Scheduler,
    UpsertTask,
)


class OperatorExecutor(FakeExecutor):
    """``FakeExecutor`` plus operators: embed -> text lengths, rerank -> reversed, upsert ->
    ids. ``reverse_results`` answers each retrieval batch in reverse order."""

    def __init__(self, reverse_results: bool = False) -> None:
        super().__init__()
        self.operator_calls: list[list] = []
        self.reverse_results = reverse_results

    def submit_retrieval(self, tasks: list) -> None:
        super().submit_retrieval(tasks)
        if self.reverse_results:
            self._results.reverse()

    def submit_operators(self, tasks: list) -> None:
        self.operator_calls.append(list(tasks))
        for t in tasks:
            if isinstance(t, EmbedTask):
                value = [float(len(x)) for x in t.texts]
            elif isinstance(t, RerankTask):
                value = list(reversed(t.passages))[: t.topk]
            else:
                assert isinstance(t, UpsertTask)
                value = [getattr(d, "id", f"gen-{i}") for i, d in enumerate(t.documents)]
            self._results.append(OperatorResult(t.task_id, value))


def _run(sched: Scheduler, requests: list, limit_s: float = 60.0) -> dict:
    done: dict = {}
    for req in requests:
        req.on_done = lambda r, done=done: done.__setitem__(r.request_id, r)
        sched.add_request(req)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sched.step()
        if not sched.has_unfinished():
            return done
        time.sleep(0.001)  # NOTE: the fake executor never waits; function threads need the GIL
    raise AssertionError("scheduler did not finish")


def _req(rid: str, graph, question: str = "q", **state) -> RequestState:
    return RequestState(rid, graph, State(input=question, **state), on_done=None)


def _chain(g: RAGraph, *ids) -> RAGraph:
    for a, b in zip((START, *ids), (*ids, END), strict=True):
        g.add_edge(a, b)
    return g


def test_function_node_writes_its_value_from_a_state_snapshot() -> None:
    seen = []

    def fn(state):
        seen.append(threading.current_thread().name)
        state["input"] = "mutated"  # a snapshot: the request's state is not touched
        return len(state["docs"])

    g = RAGraph().add_retrieval(0, query="input", topk=3, output="docs")
    g = _chain(g.add_function(1, fn, output="n").add_generation(2, prompt="{n} {input}"), 0, 1, 2)
    done = _run(Scheduler(FakeExecutor()), [_req("r", g.compile(), "question")])
    r = done["r"]
    assert r.error is None and r.state["n"] == 3 and r.state["input"] == "question"
    assert r.output == "g(3 question)" and seen == ["ragserve-function"]
    assert [t.kind for t in r.node_timings] == ["retrieval", "function", "generation"]


def test_function_exception_and_timeout_fail_only_their_request() -> None:
    release = threading.Event()

    def boom(state):
        raise KeyError("missing")

    def hang(state):
        release.wait(10)
        return "late"

    def graph(fn, **kw):
        g = RAGraph().add_function("f", fn, output="x", **kw)
        return _chain(g.add_generation("g", prompt="{x}"), "f", "g").compile()

    ok = graph(lambda s: "fine")
    sched = Scheduler(FakeExecutor(), operators=OperatorConfig(function_timeout_s=5.0))
    try:
        reqs = [
            _req("boom", graph(boom)),
            _req("hang", graph(hang, timeout_s=0.2)),
            *[_req(f"ok{i}", ok) for i in range(3)],
        ]
        done = _run(sched, reqs)
    finally:
        release.set()
        sched.close()
    assert done["boom"].error == "node 'f' failed: function raised KeyError: 'missing'"
    assert done["boom"].error_kind == "internal"
    assert done["hang"].error == "node 'f' failed: function timed out after 0.2 s"
    assert [done[f"ok{i}"].output for i in range(3)] == ["g(fine)"] * 3
    assert all(done[f"ok{i}"].error is None for i in range(3))


def test_timed_out_calls_do_not_starve_the_pool() -> None:
    """Every function thread stuck in a timed-out call: replacements still serve the rest."""
    release = threading.Event()
    hang = _chain(RAGraph().add_function("f", lambda s: release.wait(10), output="x"), "f")
    ok = _chain(RAGraph().add_function("f", lambda s: s["input"], output="output"), "f")
    config = OperatorConfig(function_workers=1, function_timeout_s=0.1)
    sched = Scheduler(FakeExecutor(), operators=config)
    try:
        done = _run(sched, [_req(f"h{i}", hang.compile()) for i in range(3)])
        assert {r.error for r in done.values()} == {
            "node 'f' failed: function timed out after 0.1 s"
        }
        done = _run(sched, [_req("ok", ok.compile(), "still served")])
    finally:
        release.set()
        sched.close()
    assert done["ok"].output == "still served"


def test_memory_nodes_read_and_append_per_session_within_bounds() -> None:
    g = RAGraph(inputs=("session",)).add_memory("read", key="session", output="memory")
    g.add_generation("answer", prompt="{memory}|{input}")
    g.add_memory("write", key="session", mode="append", text="{input}")
    graph = _chain(g, "read", "answer", "write").compile()
    config = OperatorConfig(memory_max_entries=2, memory_max_bytes=1000)
    sched = Scheduler(FakeExecutor(), operators=config)
    outputs = []
    for i, session in enumerate(["a", "a", "b", "a", "a"]):
        done = _run(sched, [_req(f"r{i}", graph, f"turn{i}", session=session)])
        outputs.append(done[f"r{i}"].state["memory"])
    assert outputs == [[], ["turn0"], [], ["turn0", "turn1"], ["turn1", "turn3"]]
    assert sched.memory.read("a") == ["turn3", "turn4"]  # 2 entries: oldest dropped
    sched.memory.check_integrity()


def test_memory_store_byte_bound_drops_oldest_first() -> None:
    from ragserve.scheduler import MemoryStore

    store = MemoryStore(max_entries=100, max_bytes=10, max_sessions=2)
    for text in ("abcd", "efgh", "ijkl"):
        store.append("s", text)
    assert store.read("s") == ["efgh", "ijkl"]
    assert store.append("s", "x" * 25) == "x" * 10 and store.read("s") == ["x" * 10]
    store.append("t", "t")
    store.append("u", "u")  # a third session: the least recently used ("s") goes
    assert store.read("s") == [] and store.read("u") == ["u"]
    store.check_integrity()
    with pytest.raises(ValueError, match="session id must be a non-empty string"):
        store.read("")


def test_memory_node_without_a_session_id_is_a_bad_request() -> None:
    g = _chain(RAGraph(inputs=("session",)).add_memory("m", key="session", output="x"), "m")
    done = _run(Scheduler(FakeExecutor()), [_req("r", g.compile(), session=7)])
    assert done["r"].error_kind == "bad_request"
    assert "key: state['session'] must hold a non-empty session id" in done["r"].error


def test_retrieval_worker_operators_are_batched_across_requests() -> None:
    g = RAGraph().add_embed("e", text="input", output="vec")
    g.add_retrieval("r", query="input", topk=3, output="docs")
    g.add_rerank("k", query="input", docs="docs", topk=2, output="best")
    g.add_upsert("u", documents="input", output="ids")
    graph = _chain(g, "e", "r", "k", "u").compile()
    ex = OperatorExecutor()
    done = _run(Scheduler(ex), [_req(f"q{i}", graph, "x" * (i + 1)) for i in range(4)])
    assert [len(c) for c in ex.operator_calls] == [4, 4, 4]  # embed, rerank, upsert batches
    assert [type(c[0]).__name__ for c in ex.operator_calls] == [
        "EmbedTask",
        "RerankTask",
        "UpsertTask",
    ]
    r = done["q2"]
    assert r.error is None and r.state["vec"] == [3.0] and r.state["ids"] == ["gen-0"]
    assert [p.doc_id for p in r.state["best"]] == [p.doc_id for p in r.state["docs"][::-1][:2]]


def _fan_graph():
    g = RAGraph()
    g.add_retrieval("a", query="input", topk=2, output="docs_a")
    g.add_retrieval("b", query="{input} again", topk=2, output="docs_b")
    g.add_function("count", lambda s: len(s["docs_b"]), output="num_b")
    g.add_generation("join", prompt="{docs_a}|{docs_b}|{num_b}")
    g.add_edge(START, ("a", "b")).add_edge("a", "join").add_edge("b", "count")
    return g.add_edge("count", "join").add_edge("join", END).compile()


@pytest.mark.parametrize("reverse", [False, True])
def test_fanout_branches_run_together_and_join_deterministically(reverse: bool) -> None:
    ex = OperatorExecutor(reverse_results=reverse)
    done = _run(Scheduler(ex), [_req(f"r{i}", _fan_graph(), f"q{i}") for i in range(3)])
    assert [len(c) for c in ex.retrieval_calls] == [6]  # both branches of all requests at once
    plain = FakeExecutor()
    for i in range(3):
        r = done[f"r{i}"]
        assert r.error is None and r.state["num_b"] == 2
        a = [p.doc_id for p in r.state["docs_a"]]
        b = [p.doc_id for p in r.state["docs_b"]]
        assert list(r.doc_ids) == list(dict.fromkeys(a + b))  # branch order, not finish order
        assert [t.node_id for t in r.node_timings][-1] == "join"
    plain_done = _run(Scheduler(plain), [_req(f"r{i}", _fan_graph(), f"q{i}") for i in range(3)])
    assert {k: v.state for k, v in done.items()} == {k: v.state for k, v in plain_done.items()}
    assert {k: v.doc_ids for k, v in done.items()} == {k: v.doc_ids for k, v in plain_done.items()}


def test_failed_branch_fails_the_request_and_aborts_the_other() -> None:
    g = RAGraph()
    g.add_generation("slow", prompt="{input}", output="text")
    g.add_function("bad", lambda s: 1 / 0, output="x")
    g.add_generation("join", prompt="{text}{x}")
    g.add_edge(START, ("slow", "bad")).add_edge("slow", "join").add_edge("bad", "join")
    ex = FakeExecutor()
    sched = Scheduler(ex)
    done = _run(sched, [_req("r", g.add_edge("join", END).compile())])
    assert (
        done["r"].error == "node 'bad' failed: function raised ZeroDivisionError: division by zero"
    )
    assert not sched.has_unfinished()


def test_completion_node_streams_raw_updates() -> None:
    params = GenerationParams(max_tokens=4, ignore_eos=True)
    graph = _chain(RAGraph().add_completion(0, params=params), 0).compile()
    updates = []
    req = _req("c", graph, "raw prompt")
    req.on_update = updates.append
    ex = FakeExecutor()
    done = _run(Scheduler(ex), [req])
    (task,) = ex.generation_calls[0]
    assert task.chat is False and task.prompt == "raw prompt" and task.params == params
    assert done["c"].output == "g(raw prompt)" and [u.finished for u in updates] == [False, True]
    assert done["c"].node_timings[0].kind == "completion" and done["c"].node_timings[0].is_answer


def test_function_nodes_run_concurrently_across_requests() -> None:
    barrier = threading.Barrier(3, timeout=5)

    def meet(state):
        barrier.wait()  # only returns once three calls run at the same time
        return time.monotonic()

    g = _chain(RAGraph().add_function("f", meet, output="t"), "f").compile()
    sched = Scheduler(FakeExecutor(), operators=OperatorConfig(function_workers=3))
    try:
        done = _run(sched, [_req(f"r{i}", g) for i in range(3)])
    finally:
        sched.close()
    assert all(r.error is None for r in done.values())
