"""Generation sub-stages: a task with ``chunk_s`` reports in chunks of decode steps, with the
same deltas, token ids, final text and finish reason as per-step updates (greedy, tiny model).

The runner's clock is a fake that advances 1.0 s per call pair, so every engine step "takes"
1 s and ``chunk_s=3.0`` is exactly three decode steps: chunk boundaries are deterministic.
"""

from __future__ import annotations

import itertools
import math

import pytest

from ragserve.graph import END, START, RAGraph, State
from ragserve.runtime.executors import LocalExecutor
from ragserve.runtime.runners import GenerationRunner
from ragserve.scheduler import GenerationParams, GenerationTask, RequestState, Scheduler
from ragserve.scheduler.cosched import SplitTransform

PROMPTS = ["Tell me about Peru.", "What is RAG?", "Kenya", "The capital of Chile is"]


@pytest.fixture(scope="module")
def engine(tiny_model: str):
    from ragserve.generation import LLMEngine

    # NOTE: prefix caching off: both runs must compute the same logits in the same order.
    return LLMEngine(tiny_model, device="cpu", enable_prefix_caching=False)


def step_clock():
    """1.0 s between each call pair: every ``engine.step()`` is measured as 1 s."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def run(engine, tasks: list[GenerationTask]) -> dict[str, list]:
    """All updates per task, running the runner until the engine is idle."""
    runner = GenerationRunner(engine, clock=step_clock())
    out: dict[str, list] = {t.task_id: [] for t in tasks}
    for u in runner.add(tasks):
        out[u.task_id].append(u)
    while runner.has_work():
        for u in runner.step():
            out[u.task_id].append(u)
    assert runner._progress == {}
    return out


def joined(updates: list) -> tuple:
    """What a consumer assembles from a task's updates."""
    return (
        "".join(u.text_delta for u in updates),
        tuple(t for u in updates for t in u.new_token_ids),
        updates[-1].final_text,
        updates[-1].finish_reason,
        [u.prompt_token_ids for u in updates if u.prompt_token_ids is not None],
        [u.finished for u in updates].index(True) == len(updates) - 1,  # one final, the last
    )


class NoRetrieval:
    """The retrieval side of a generation-only ``LocalExecutor``."""

    def has_pending(self) -> bool:
        return False


def tasks(chunk_s: float | None, stop: tuple[str, ...] = (), max_tokens=(9, 17, 24, 5)):
    return [
        GenerationTask(
            f"t{i}", p, GenerationParams(max_tokens=m, stop=stop, ignore_eos=True), True, chunk_s
        )
        for i, (p, m) in enumerate(zip(PROMPTS, max_tokens, strict=True))
    ]


def test_chunked_updates_equal_per_step_updates(engine) -> None:
    plain = run(engine, tasks(None))
    chunked = run(engine, tasks(3.0))
    for tid, updates in plain.items():
        assert joined(chunked[tid]) == joined(updates)
        assert [len(u.new_token_ids) for u in updates] == [1] * len(updates)
        # first token at once, then 3 steps per update, the final one with the rest
        sizes = [len(u.new_token_ids) for u in chunked[tid]]
        n = len(updates)
        assert sizes == [1] + [3] * ((n - 2) // 3) + ([(n - 1) % 3 or 3] if n > 1 else [])
        assert chunked[tid][0] == updates[0]  # TTFT: the first update is not delayed


def test_coalesced_updates_are_first_and_final_only(engine) -> None:
    """``chunk_s = inf`` (the scheduler's update coalescing): two updates per task."""
    plain = run(engine, tasks(None))
    coalesced = run(engine, tasks(math.inf))
    for tid, updates in plain.items():
        assert joined(coalesced[tid]) == joined(updates)
        assert coalesced[tid][0] == updates[0]
        assert len(coalesced[tid]) == min(2, len(updates))


def test_stop_string_with_holdback_is_cut_the_same(engine) -> None:
    free = run(engine, tasks(None, max_tokens=(24, 24, 24, 24)))
    # a stop string taken from the middle of the first task's unconstrained text
    text = free["t0"][-1].final_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    plain = run(engine, tasks(None, stop=(stop,), max_tokens=(24, 24, 24, 24)))
    chunked = run(engine, tasks(2.0, stop=(stop,), max_tokens=(24, 24, 24, 24)))
    assert plain["t0"][-1].finish_reason == "stop"
    assert stop not in plain["t0"][-1].final_text
    for tid, updates in plain.items():
        assert joined(chunked[tid]) == joined(updates)
        assert "".join(u.text_delta for u in updates) == updates[-1].final_text


def test_abort_frees_a_chunked_task_and_errors_are_immediate(engine) -> None:
    runner = GenerationRunner(engine, clock=step_clock())
    bad = GenerationTask("bad", (), GenerationParams(max_tokens=4), False, 5.0)
    errors = runner.add([*tasks(100.0, max_tokens=(40, 40, 40, 40))[:2], bad])
    assert [(u.task_id, u.error_kind, u.finished) for u in errors] == [("bad", "bad_request", True)]
    # the first token, at once (overlapped scheduling returns a step's tokens in the next call)
    first = [u for _ in range(2) for u in runner.step()]
    assert sorted(u.task_id for u in first) == ["t0", "t1"]
    for _ in range(3):
        assert runner.step() == []  # held: 100 s chunks
    runner.abort(["t0"])
    assert set(runner._progress) == {"t1"}
    assert engine.stats()["running"] == 1
    runner.abort(["t1", "t1", "unknown"])
    assert runner._progress == {} and not runner.has_work()
    assert engine.stats()["kv_blocks_used"] == 0


def test_scheduler_with_split_chunks_runs_fewer_cycles_same_outputs(engine) -> None:
    """Scheduler + ``SplitTransform(budget_s=3.0)`` + ``LocalExecutor``: same outputs as without
    the transform, one update per chunk and fewer scheduler cycles (the executor keeps
    stepping while a step yields no update)."""

    def serve(transforms) -> tuple[dict, int, int]:
        runner = GenerationRunner(engine, clock=step_clock())
        executor = LocalExecutor(runner, retrieval=NoRetrieval())
        scheduler = Scheduler(executor, transforms, poll_timeout=60.0)
        done: dict = {}
        for i, prompt in enumerate(PROMPTS):
            params = GenerationParams(max_tokens=12 + 5 * i, ignore_eos=True)
            graph = RAGraph().add_completion(0, params=params).add_edge(START, 0)
            compiled = graph.add_edge(0, END).compile()
            req = RequestState(f"r{i}", compiled, State(input=prompt), on_done=None)
            req.on_done = lambda r, done=done: done.__setitem__(r.request_id, r)
            scheduler.add_request(req)
        while scheduler.has_unfinished():
            scheduler.step()
        return done, scheduler.num_cycles, runner.num_updates

    plain, plain_cycles, plain_updates = serve(())
    chunked, chunk_cycles, chunk_updates = serve((SplitTransform(budget_s=3.0),))
    assert {k: r.output for k, r in chunked.items()} == {k: r.output for k, r in plain.items()}
    assert [r.error for r in chunked.values()] == [None] * len(PROMPTS)
    tokens = sum(12 + 5 * i for i in range(len(PROMPTS)))
    assert plain_updates == tokens
    assert chunk_updates < tokens / 2
    assert chunk_cycles < plain_cycles
    for r in chunked.values():
        timing = r.node_timings[0]
        assert timing.num_tokens == 12 + 5 * int(r.request_id[1:])
        assert timing.first_token_at is not None
