"""Speculative generation under every order of arrival: no request is lost, outputs are exact.

The executor here is a real ``BaseExecutor`` whose ``poll`` returns exactly what the test
released since the last poll, in release order, so each test scripts one interleaving of the
retrieval's partial and final results, the speculation's updates, and aborts (as the Ray
backend's polls interleave them). Generation text is a function of the prompt, so the oracle
is the same request run without transforms.
"""

from __future__ import annotations

import random
import zlib

import pytest

from ragserve.graph import END, START, Passage, RAGraph, State
from ragserve.scheduler import (
    BaseExecutor,
    GenerationTask,
    GenerationUpdate,
    RequestState,
    RetrievalResult,
    RetrievalTask,
    Scheduler,
)
from ragserve.scheduler.cosched import SpeculationTransform
from ragserve.scheduler.messages import RetrievalPartial
from ragserve.workflows import get_workflow

NUM_CHUNKS = 3
GRAPH = get_workflow("oneshot", topk=2, max_tokens=NUM_CHUNKS)


def docs(*ids: str) -> tuple[Passage, ...]:
    return tuple(Passage(i, f"text of {i}", f"T{i}") for i in ids)


RIGHT, WRONG = docs("d1", "d2"), docs("d1", "d9")


class ScriptedExecutor(BaseExecutor):
    """Delivers only what the test releases; ``auto`` releases everything at each poll.

    A generation task's updates are ``NUM_CHUNKS`` pieces of a text derived from its prompt,
    the last ``finished`` (reason ``length``). ``release_gen`` moves a task's next pieces to
    the outbox: they are then in flight, and an abort after it does not recall them (as on
    Ray, where a replica's poll result can already be on its way). An aborted task makes no
    further pieces. A task in ``failing`` answers its next release with an error update.
    """

    def __init__(self, auto_docs: dict[str, tuple[Passage, ...]] | None = None) -> None:
        self.auto_docs = auto_docs  # request id -> final docs, for ``auto`` mode
        self.generations: dict[str, GenerationTask] = {}
        self.retrievals: dict[str, RetrievalTask] = {}
        self.aborted: list[str] = []
        self.failing: set[str] = set()
        self._pieces: dict[str, list[GenerationUpdate]] = {}
        self._outbox: list = []

    # -- BaseExecutor -----------------------------------------------------------------------
    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        for t in tasks:
            assert t.task_id not in self.generations, f"{t.task_id} submitted twice"
            self.generations[t.task_id] = t
            self._pieces[t.task_id] = _pieces(t)

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        for t in tasks:
            self.retrievals[t.task_id] = t

    def abort(self, task_ids: list[str]) -> None:
        for tid in task_ids:
            self.aborted.append(tid)
            self._pieces.pop(tid, None)

    def poll(self, timeout: float) -> list:
        if self.auto_docs is not None:
            for tid in list(self.retrievals):
                self.release_final(tid, self.auto_docs[tid.split("/")[0]])
            for tid in list(self._pieces):
                self.release_gen(tid)
        out, self._outbox = self._outbox, []
        return out

    # -- the script ---------------------------------------------------------------------------
    def release_partial(self, task_id: str, passages: tuple[Passage, ...]) -> None:
        assert task_id in self.retrievals
        self._outbox.append(RetrievalPartial(task_id, passages, 1))

    def release_final(self, task_id: str, passages: tuple[Passage, ...]) -> None:
        del self.retrievals[task_id]
        self._outbox.append(RetrievalResult(task_id, passages))

    def release_gen(self, task_id: str, n: int | None = None) -> None:
        pieces = self._pieces.get(task_id, [])
        if task_id in self.failing and pieces:
            self._outbox.append(GenerationUpdate(task_id, "", (), True, error="replica died"))
            pieces.clear()
        n = len(pieces) if n is None else n
        self._outbox.extend(pieces[:n])
        del pieces[:n]
        if not pieces:
            self._pieces.pop(task_id, None)

    def deliver(self, updates: list) -> None:
        """Updates that were already on their way (e.g. sent before an abort landed)."""
        self._outbox.extend(updates)

    def shuffle(self, rng: random.Random) -> None:
        """Interleave the next poll's updates at random, each task's own kept in order."""
        lanes: dict[str, list] = {}
        for u in self._outbox:
            lanes.setdefault(u.task_id, []).append(u)
        queues, out = list(lanes.values()), []
        while queues:
            i = rng.randrange(len(queues))
            out.append(queues[i].pop(0))
            if not queues[i]:
                queues.pop(i)
        self._outbox = out

    def running(self) -> list[str]:
        return list(self._pieces)

    def spec_of(self, request_id: str) -> str:
        """The id of the (only) speculative task started for ``request_id``'s retrieval."""
        (tid,) = [t for t in self.generations if t.startswith("spec/") and f"/{request_id}/" in t]
        return tid


def _pieces(task: GenerationTask) -> list[GenerationUpdate]:
    text = f"<{zlib.crc32(repr(task.prompt).encode()):08x}>"
    step = -(-len(text) // NUM_CHUNKS)
    out = []
    for i in range(NUM_CHUNKS):
        last = i == NUM_CHUNKS - 1
        out.append(
            GenerationUpdate(
                task.task_id,
                text[i * step : (i + 1) * step],
                (i,),
                last,
                "length" if last else None,
            )
        )
    return out


class Harness:
    """One scheduler with a ``SpeculationTransform`` over a ``ScriptedExecutor``."""

    def __init__(self, request_ids: list[str], graph=GRAPH) -> None:
        self.ex = ScriptedExecutor()
        self.spec = SpeculationTransform(capacity=1000)
        self.sched = Scheduler(self.ex, [self.spec], poll_timeout=0.0)
        self.done: dict = {}
        for rid in request_ids:
            self.sched.add_request(_request(rid, self.done, graph))
        self.sched.step()  # admitted; the retrievals are dispatched

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.sched.step()

    def retrieval(self, request_id: str) -> str:
        return f"{request_id}/0/1"

    def real(self, request_id: str) -> str:
        return f"{request_id}/1/2"

    def speculate(self, request_id: str, passages=RIGHT) -> str:
        """Release the partial: the speculation starts, and is dispatched one step later."""
        self.ex.release_partial(self.retrieval(request_id), passages)
        self.step(2)
        return self.ex.spec_of(request_id)

    def settle(self, max_steps: int = 20) -> None:
        """Step until idle, releasing whatever generation is left (never a retrieval)."""
        for _ in range(max_steps):
            for tid in self.ex.running():
                self.ex.release_gen(tid)
            self.step()
            if not self.sched.has_unfinished() and not self.ex.running():
                self.step()  # one more cycle: the transform drops what is stale
                return
        lost = sorted(set(self.sched._by_task))  # NOTE: private, to name the lost task
        raise AssertionError(f"never finished: {sorted(self.sched._active)}, tasks {lost}")

    def check_idle(self) -> None:
        assert not self.sched.has_unfinished() and not self.sched._by_task
        assert self.spec.num_in_flight == 0
        self.spec.check_integrity()


def _request(rid: str, done: dict, graph=GRAPH) -> RequestState:
    req = RequestState(rid, graph, State(input=f"question {rid}"), on_done=None)
    req.on_done = lambda r: done.__setitem__(r.request_id, r)
    return req


def oracle(final_docs: dict[str, tuple[Passage, ...]], graph=GRAPH) -> dict[str, str]:
    """Each request's output without speculation, with the given final retrieval results."""
    ex = ScriptedExecutor(auto_docs=final_docs)
    sched = Scheduler(ex, [], poll_timeout=0.0)
    done: dict = {}
    for rid in final_docs:
        sched.add_request(_request(rid, done, graph))
    for _ in range(50):
        sched.step()
        if not sched.has_unfinished():
            break
    assert set(done) == set(final_docs) and all(r.error is None for r in done.values())
    return {rid: r.output for rid, r in done.items()}


def _assert_exact(h: Harness, final_docs: dict[str, tuple[Passage, ...]], graph=GRAPH) -> None:
    want = oracle(final_docs, graph)
    assert {r: d.output for r, d in h.done.items()} == want
    assert all(d.error is None for d in h.done.values())
    h.check_idle()


# -- one request, every order of the final result and the speculation's updates --------------
ORDERS = [
    "spec_done_before_final",  # all updates polled before the final result
    "spec_done_same_poll_before_final",  # one poll: all updates, then the final
    "final_then_spec_done_same_poll",  # one poll: the final, then all updates
    "final_then_spec_next_polls",  # adopted first, the updates follow one per poll
    "first_update_then_final_then_rest",
    "final_and_first_update_consecutive",  # the known issue's suspect
    "partial_and_final_same_poll",  # speculation confirmed before it was dispatched
]


@pytest.mark.parametrize("order", ORDERS)
def test_confirmed_speculation_is_adopted_in_every_order(order: str) -> None:
    h = Harness(["r0"])
    ex, r = h.ex, h.retrieval("r0")
    if order == "partial_and_final_same_poll":
        ex.release_partial(r, RIGHT)
        ex.release_final(r, RIGHT)
        h.step()
    else:
        sid = h.speculate("r0")
        if order == "spec_done_before_final":
            ex.release_gen(sid)
            h.step()
            ex.release_final(r, RIGHT)
        elif order == "spec_done_same_poll_before_final":
            ex.release_gen(sid)
            ex.release_final(r, RIGHT)
        elif order == "final_then_spec_done_same_poll":
            ex.release_final(r, RIGHT)
            ex.release_gen(sid)
        elif order == "final_then_spec_next_polls":
            ex.release_final(r, RIGHT)
            for _ in range(NUM_CHUNKS):
                h.step()
                ex.release_gen(sid, 1)
        elif order == "first_update_then_final_then_rest":
            ex.release_gen(sid, 1)
            h.step()
            ex.release_final(r, RIGHT)
            h.step()
            ex.release_gen(sid)
        elif order == "final_and_first_update_consecutive":
            ex.release_final(r, RIGHT)
            h.step()
            ex.release_gen(sid, 1)
    h.settle()
    _assert_exact(h, {"r0": RIGHT})
    s = h.spec.stats
    assert (s.num_started, s.num_confirmed, s.num_adopted, s.num_aborted) == (1, 1, 1, 0)
    assert h.real("r0") not in ex.generations  # adopted: the real task never ran


@pytest.mark.parametrize("when", ["before_final", "same_poll_before", "same_poll_after", "after"])
def test_rejected_speculation_with_updates_in_flight(when: str) -> None:
    h = Harness(["r0"])
    ex, r = h.ex, h.retrieval("r0")
    sid = h.speculate("r0", WRONG)
    released = 0 if when == "after" else 2
    if when == "before_final":
        ex.release_gen(sid, released)
        h.step()
        ex.release_final(r, RIGHT)
    elif when == "same_poll_before":
        ex.release_gen(sid, released)
        ex.release_final(r, RIGHT)
    elif when == "same_poll_after":
        ex.release_final(r, RIGHT)
        ex.release_gen(sid, released)
    else:
        ex.release_final(r, RIGHT)
    h.step()
    assert sid in ex.aborted
    # updates already on their way when the abort was sent arrive after it
    ex.deliver(_pieces(ex.generations[sid])[released:])
    h.settle()
    _assert_exact(h, {"r0": RIGHT})
    s = h.spec.stats
    assert (s.num_wrong, s.num_adopted) == (1, 0) and h.real("r0") in ex.generations


@pytest.mark.parametrize("when", ["speculating", "confirmed", "adopted"])
def test_abort_while_speculating(when: str) -> None:
    h = Harness(["r0", "r1"])
    ex = h.ex
    sid = h.speculate("r0")
    h.speculate("r1")
    ex.release_gen(sid, 1)
    if when != "speculating":
        ex.release_final(h.retrieval("r0"), RIGHT)
        h.step()
    if when.startswith("adopted"):
        h.step()
        assert h.spec.stats.num_adopted == 1
    h.sched.abort("r0")
    h.step()
    ex.release_final(h.retrieval("r1"), RIGHT)
    h.settle()
    assert h.done["r0"].error_kind == "aborted"
    assert h.done["r1"].error is None and h.done["r1"].output == oracle({"r1": RIGHT})["r1"]
    assert sid in ex.aborted  # the engine does not keep generating for nobody
    assert h.real("r0") not in ex.generations
    h.check_idle()


def test_failed_speculation_before_adoption_runs_the_real_task() -> None:
    h = Harness(["r0"])
    ex = h.ex
    sid = h.speculate("r0")
    ex.failing.add(sid)
    ex.release_gen(sid)  # the replica died under the speculation
    ex.release_final(h.retrieval("r0"), RIGHT)
    h.settle()
    _assert_exact(h, {"r0": RIGHT})
    assert h.real("r0") in ex.generations


# -- several requests in one poll: adoptions must not touch each other -----------------------
@pytest.mark.parametrize("finished_first", [True, False])
def test_two_adoptions_in_one_cycle(finished_first: bool) -> None:
    """The known issue: r0's speculation finished (all updates buffered) and r1's had sent
    nothing when both finals arrived in one poll. Adopting r0 then r1 in one cycle read r0's
    buffered ``finished`` as r1's and forgot r1's speculation: r1's real task was never
    answered. Either order of the two requests is covered."""
    order = ["r0", "r1"] if finished_first else ["r1", "r0"]
    h = Harness(order)
    ex = h.ex
    spec_ids = {rid: h.speculate(rid) for rid in order}
    ex.release_gen(spec_ids["r0"])
    h.step()
    for rid in order:
        ex.release_final(h.retrieval(rid), RIGHT)
    h.step(2)  # confirmed, then both real tasks adopted in one cycle
    assert h.spec.stats.num_adopted == 2
    h.settle()
    _assert_exact(h, {"r0": RIGHT, "r1": RIGHT})


@pytest.mark.parametrize("seed", range(200))
def test_random_interleavings_lose_nothing(seed: int) -> None:
    """Random polls over many requests: partials (right or wrong docs), finals (alone or a
    whole retrieval batch at once), a few pieces of any generation at a time, the odd abort;
    each seed draws its own rates. Every request ends; outputs are exact."""
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(8)]
    final = {rid: RIGHT if rng.random() < 0.7 else WRONG for rid in ids}
    p_partial, p_final, p_batch, p_gen = (rng.uniform(0.05, 0.6) for _ in range(4))
    h = Harness(ids)
    ex = h.ex
    aborted: set[str] = set()
    for _ in range(400):
        batch = rng.random() < p_batch / 4
        for tid in list(ex.retrievals):
            if rng.random() < p_partial:
                ex.release_partial(tid, RIGHT if rng.random() < 0.6 else WRONG)
            if batch or rng.random() < p_final / 4:
                ex.release_final(tid, final[tid.split("/")[0]])
        for tid in ex.running():
            if rng.random() < p_gen:
                ex.release_gen(tid, rng.randint(1, NUM_CHUNKS))
        ex.shuffle(rng)
        if rng.random() < 0.01:
            victim = rng.choice(ids)
            aborted.add(victim)
            h.sched.abort(victim)
        h.step()
        if not h.sched.has_unfinished() and not ex.running():
            break
    h.settle()
    assert set(h.done) == set(ids)
    failed = {r for r, d in h.done.items() if d.error is not None}
    assert failed <= aborted and all(h.done[r].error_kind == "aborted" for r in failed)
    kept = {rid: final[rid] for rid in ids if h.done[rid].error is None}
    assert {r: h.done[r].output for r in kept} == oracle(kept)
    h.check_idle()


def test_partial_after_the_final_starts_nothing_lasting() -> None:
    """A partial polled after its retrieval's final result (same poll) may start a
    speculation nobody can confirm: it is dropped at once, not left running to the end."""
    h = Harness(["r0"])
    ex, r = h.ex, h.retrieval("r0")
    ex.release_final(r, RIGHT)
    ex.deliver([RetrievalPartial(r, RIGHT, 1)])
    h.step(2)  # the real task is dispatched; the late speculation is dropped before it ran
    s = h.spec.stats
    assert (s.num_started, s.num_aborted, s.num_adopted) == (1, 1, 0)
    assert h.spec.num_in_flight == 0
    assert [t for t in ex.generations if t.startswith("spec/")] == []
    assert h.real("r0") in ex.generations
    h.settle()
    _assert_exact(h, {"r0": RIGHT})


def _fanout_graph():
    """Two branches, each a retrieval then a generation on its passages, then an answer."""
    g = RAGraph("two_branches")
    g.add_retrieval("ra", query="input", topk=2, output="docs_a")
    g.add_retrieval("rb", query="{input} b", topk=2, output="docs_b")
    g.add_generation("ga", prompt="A {docs_a} {input}", output="out_a", max_tokens=NUM_CHUNKS)
    g.add_generation("gb", prompt="B {docs_b} {input}", output="out_b", max_tokens=NUM_CHUNKS)
    g.add_generation("answer", prompt="{out_a} {out_b}", max_tokens=NUM_CHUNKS)
    g.add_edge(START, ("ra", "rb")).add_edge("ra", "ga").add_edge("rb", "gb")
    return g.add_edge("ga", "answer").add_edge("gb", "answer").add_edge("answer", END).compile()


def test_both_branches_of_a_fanout_adopt_their_own_speculation() -> None:
    graph = _fanout_graph()
    h = Harness(["r0"], graph)
    ex = h.ex
    retrievals = sorted(ex.retrievals)
    assert len(retrievals) == 2
    for tid in retrievals:
        ex.release_partial(tid, RIGHT)
    h.step(2)
    spec_ids = [t for t in ex.generations if t.startswith("spec/")]
    assert len(spec_ids) == 2
    for tid in spec_ids:
        ex.release_gen(tid, 1)
    for tid in retrievals:
        ex.release_final(tid, RIGHT)
    h.step(2)
    assert h.spec.stats.num_adopted == 2  # each real task took its own branch's speculation
    h.settle()
    _assert_exact(h, {"r0": RIGHT}, graph)
    assert not any(t.split("/")[1] in ("ga", "gb") for t in ex.generations if "spec" not in t)
