"""The scheduler's control loop over a deterministic fake executor."""

from __future__ import annotations

import pytest
from sched_fakes import FakeExecutor

from ragserve.graph import END, START, RAGraph, State
from ragserve.scheduler import BaseTransform, RequestState, Scheduler, Wavefront
from ragserve.workflows import get_workflow


def _run(scheduler: Scheduler, requests: list[RequestState], max_cycles: int = 200) -> dict:
    done: dict = {}
    for req in requests:
        req.on_done = lambda r, done=done: done.__setitem__(r.request_id, r)
        scheduler.add_request(req)
    for _ in range(max_cycles):
        scheduler.step()
        if not scheduler.has_unfinished():
            return done
    raise AssertionError("scheduler did not finish")


def _req(rid: str, graph, question: str = "q", on_delta=None) -> RequestState:
    return RequestState(rid, graph, State(input=question), on_done=None, on_delta=on_delta)


def test_ready_retrievals_of_all_requests_go_out_as_one_batch() -> None:
    ex = FakeExecutor()
    sched = Scheduler(ex)
    graph = get_workflow("oneshot", topk=2)
    done = _run(sched, [_req(f"r{i}", graph, f"question {i}") for i in range(5)])
    assert [len(c) for c in ex.retrieval_calls] == [5]
    assert [len(c) for c in ex.generation_calls] == [5]
    r3 = done["r3"]
    assert r3.error is None
    assert r3.output == f"g({'Use the pass'})"
    assert len(r3.doc_ids) == 2 and r3.titles[0].startswith("T")
    assert [t.kind for t in r3.node_timings] == ["retrieval", "generation"]
    assert all(t.finished_at >= t.ready_at for t in r3.node_timings)
    assert r3.node_timings[1].num_tokens == 2 and r3.ttft is not None
    assert set(r3.timings) == {0, 1} and all(v >= 0 for v in r3.timings.values())


def test_rendered_prompt_holds_the_state() -> None:
    ex = FakeExecutor()
    g = RAGraph().add_retrieval(0, query="input", topk=1, output="docs")
    g.add_generation(1, prompt="{docs}|{input}").add_edge(START, 0).add_edge(0, 1).add_edge(1, END)
    _run(Scheduler(ex), [_req("a", g.compile(), "{docs} evil {input}")])
    prompt = ex.generation_calls[0][0].prompt
    assert prompt.endswith("|{docs} evil {input}") and prompt.startswith("[1] T")


def test_node_sampling_reaches_the_generation_task() -> None:
    ex = FakeExecutor()
    g = RAGraph().add_generation(0, prompt="{input}", temperature=0.7, top_p=0.9, seed=11)
    _run(Scheduler(ex), [_req("a", g.add_edge(START, 0).add_edge(0, END).compile())])
    params = ex.generation_calls[0][0].params
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 11)


def test_requests_at_different_depths_share_cycles() -> None:
    ex = FakeExecutor()
    sched = Scheduler(ex)
    hyde, oneshot = get_workflow("hyde"), get_workflow("oneshot")
    done = _run(sched, [_req("h", hyde), _req("o", oneshot)])
    assert set(done) == {"h", "o"} and all(r.error is None for r in done.values())
    # cycle 1: h generates its hypothesis while o retrieves
    assert [t.task_id for t in ex.generation_calls[0]] == ["h/0/1"]
    assert [t.task_id for t in ex.retrieval_calls[0]] == ["o/0/1"]


@pytest.mark.parametrize("rounds", [1, 3])
def test_conditional_loops_terminate_with_exact_rounds(rounds: int) -> None:
    ex = FakeExecutor()
    done = _run(Scheduler(ex), [_req("m", get_workflow("multistep", rounds=rounds))])
    r = done["m"]
    assert r.error is None
    assert [t.node_id for t in r.node_timings] == [0, 1, 2] * rounds + [3]
    assert r.state["notes"].count("g(") == rounds


def test_stream_deltas_come_from_the_answer_node_only() -> None:
    deltas: list[str] = []
    ex = FakeExecutor()
    done = _run(Scheduler(ex), [_req("h", get_workflow("hyde"), on_delta=deltas.append)])
    assert "".join(deltas) == done["h"].output and len(deltas) == 2


def test_failed_node_fails_only_its_request() -> None:
    ex = FakeExecutor(fail_prompts_with="Write a sh")
    done = _run(
        Scheduler(ex), [_req("h", get_workflow("hyde")), _req("o", get_workflow("oneshot"))]
    )
    assert done["h"].error == "node 0 failed: boom"
    assert done["o"].error is None and done["o"].output


def test_router_that_raises_or_never_exits() -> None:
    g = RAGraph().add_generation(0, prompt="{input}")
    g.add_edge(START, 0).add_edge(0, lambda s: s["missing"])
    forever = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0)
    forever.add_edge(0, lambda s: 0)
    done = _run(
        Scheduler(FakeExecutor(), max_node_runs=5),
        [_req("a", g.compile()), _req("b", forever.compile())],
    )
    assert "router after 0" in done["a"].error and "KeyError" in done["a"].error
    assert done["b"].error == "request ran 5 nodes without reaching END"


def test_abort_stops_the_running_generation() -> None:
    ex = FakeExecutor()
    sched = Scheduler(ex)
    done: dict = {}
    req = _req("h", get_workflow("hyde"))
    req.on_done = lambda r: done.__setitem__(r.request_id, r)
    sched.add_request(req)
    sched.step()  # dispatches node 0, receives its first half
    sched.abort("h")
    sched.step()
    assert done["h"].error == "aborted" and ex.aborted == ["h/0/1"]
    assert not sched.has_unfinished()


def test_duplicate_request_id_is_rejected() -> None:
    ex = FakeExecutor()
    graph = get_workflow("oneshot")
    done: list = []
    sched = Scheduler(ex)
    for _ in range(2):
        req = _req("same", graph)
        req.on_done = done.append
        sched.add_request(req)
    while sched.has_unfinished():
        sched.step()
    assert sorted(str(r.error) for r in done) == ["None", "duplicate request id 'same'"]


class _SmallerTopK(BaseTransform):
    """A transform that rewrites the wavefront: the plug point issue #5 builds on."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def apply(self, wavefront: Wavefront) -> Wavefront:
        from dataclasses import replace

        self.seen.append(len(wavefront.generation) + len(wavefront.retrieval))
        return Wavefront(wavefront.generation, [replace(t, topk=1) for t in wavefront.retrieval])


def test_transforms_rewrite_the_wavefront() -> None:
    t = _SmallerTopK()
    done = _run(Scheduler(FakeExecutor(), [t]), [_req("o", get_workflow("oneshot", topk=4))])
    assert len(done["o"].doc_ids) == 1
    assert t.seen[:2] == [1, 1]


def test_set_transforms_waits_for_the_old_chains_work_and_applies_to_later_requests() -> None:
    sched = Scheduler(FakeExecutor())
    done: dict = {}
    keep = lambda r: done.__setitem__(r.request_id, r)  # noqa: E731
    first = _req("a", get_workflow("oneshot", topk=4))
    first.on_done = keep
    sched.add_request(first)
    sched.step()  # "a" is active, its retrieval in flight
    t = _SmallerTopK()
    switched = sched.set_transforms([t])
    later, dropped = _req("b", get_workflow("oneshot", topk=4)), _req("c", get_workflow("oneshot"))
    later.on_done = dropped.on_done = keep
    sched.add_request(later)
    sched.add_request(dropped)
    sched.abort("c")  # aborted while it waits behind the switch: still answered
    for _ in range(50):
        sched.step()
        if not sched.has_unfinished():
            break
    assert switched.done() and switched.result() is None
    assert len(done["a"].doc_ids) == 4  # finished under the old (empty) chain
    assert len(done["b"].doc_ids) == 1  # admitted after the swap
    assert done["c"].error == "aborted"
    assert sched.transforms == (t,)


def test_scheduler_work_counts_node_runs_and_excludes_the_executors_poll() -> None:
    import time

    ex = FakeExecutor()
    polls = []
    poll = ex.poll

    def slow_poll(timeout: float):
        polls.append(timeout)
        time.sleep(0.01)
        return poll(timeout)

    ex.poll = slow_poll
    sched = Scheduler(ex)
    t0 = time.perf_counter()
    done = _run(sched, [_req(f"r{i}", get_workflow("oneshot")) for i in range(4)])
    wall = time.perf_counter() - t0
    assert sched.num_node_runs == sum(len(r.node_timings) for r in done.values()) == 8
    assert 0 < sched.busy_s <= wall - 0.01 * len(polls)


@pytest.mark.parametrize("can_wake", [True, False])
def test_a_wakeable_executor_is_woken_by_input_and_polled_longer_while_busy(can_wake) -> None:
    class Wakeable(FakeExecutor):
        def __init__(self) -> None:
            super().__init__()
            self.can_wake = can_wake
            self.num_wakes = 0
            self.timeouts: list[float] = []

        def wake(self) -> None:
            self.num_wakes += 1

        def poll(self, timeout: float) -> list:
            self.timeouts.append(timeout)
            return super().poll(timeout)

    ex = Wakeable()
    sched = Scheduler(ex, poll_timeout=0.01, busy_poll_timeout=7.0)
    sched.add_request(_req("a", get_workflow("oneshot")))
    sched.abort("gone")
    sched.set_transforms(())
    assert ex.num_wakes == 3
    sched.step()  # admits and dispatches the retrieval; nothing ready after it: a busy poll
    assert ex.timeouts == [7.0 if can_wake else 0.01]
