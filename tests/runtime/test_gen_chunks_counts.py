"""Generation sub-stages end to end with the real clock: 32 requests x 64 tokens through the
``Scheduler``, in process and over the real generation worker process, with and without
``SplitTransform`` chunks. Outputs must be identical; the counts (updates per generated token,
scheduler cycles, worker messages) are printed (``pytest -s``) for BENCHMARKS.md.

Chunking never adds an update (a chunked task's updates are a subset of its per-step ones), so
that is asserted; how much it saves depends on step times and is only reported.
"""

from __future__ import annotations

import logging
import time

import pytest

from ragserve.graph import END, START, RAGraph, State
from ragserve.runtime.wire import EngineStatsMsg, GenerationResultsMsg
from ragserve.scheduler import GenerationParams, RequestState, Scheduler
from ragserve.scheduler.cosched import SplitTransform

logger = logging.getLogger(__name__)

NUM_REQUESTS, NUM_TOKENS = 32, 64
ENGINE_KWARGS = {"device": "cpu", "enable_prefix_caching": False, "max_num_seqs": NUM_REQUESTS}


class Counting:
    """Wraps an executor: counts updates seen by the scheduler and non-empty polls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_updates = 0
        self.num_update_polls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def poll(self, timeout: float) -> list:
        updates = self.inner.poll(timeout)
        self.num_updates += len(updates)
        self.num_update_polls += bool(updates)
        return updates


def serve(
    executor,
    transforms,
    poll_timeout: float,
    num_requests: int = NUM_REQUESTS,
    num_tokens: int = NUM_TOKENS,
) -> dict:
    counting = Counting(executor)
    scheduler = Scheduler(counting, transforms, poll_timeout=poll_timeout)
    params = GenerationParams(max_tokens=num_tokens, ignore_eos=True)
    graph = RAGraph().add_completion(0, params=params).add_edge(START, 0).add_edge(0, END)
    compiled = graph.compile()
    done: dict = {}
    for i in range(num_requests):
        prompt = f"Request number {i}: tell me about country {i}."
        req = RequestState(f"r{i}", compiled, State(input=prompt), on_done=None)
        req.on_done = lambda r, done=done: done.__setitem__(r.request_id, r)
        scheduler.add_request(req)
    start = time.perf_counter()
    while scheduler.has_unfinished():
        scheduler.step()
    seconds = time.perf_counter() - start
    tokens = sum(r.node_timings[0].num_tokens for r in done.values())
    assert tokens == num_requests * num_tokens
    return {
        "outputs": {k: r.output for k, r in done.items()},
        "errors": [r.error for r in done.values() if r.error is not None],
        "updates": counting.num_updates,
        "update_polls": counting.num_update_polls,
        "cycles": scheduler.num_cycles,
        "tokens": tokens,
        "seconds": seconds,
    }


def report(mode: str, key: tuple, got: dict) -> None:
    line = (
        f"gen-chunks {mode} budget_s={key[0]} poll_timeout={key[1]}: {got['updates']} updates /"
        f" {got['tokens']} tokens = {got['updates'] / got['tokens']:.3f} per token;"
        f" {got['cycles']} scheduler cycles; {got['update_polls']} polls with updates;"
        f" {got['seconds']:.2f} s ({1e3 * got['seconds'] / NUM_TOKENS:.1f} ms per decode step)"
    )
    if "gen_messages" in got:
        line += f"; {got['gen_messages']} gen messages, {got['stats_messages']} stats messages"
    print(line)  # noqa: T201 - the figures this test exists to report (pytest -s)


# (chunk budget_s, scheduler poll_timeout): ServerConfig's default poll_timeout is 0.02 s; the
# scheduler wakes at least that often, which floors its cycles whatever the chunk
RUNS = ((None, 0.02), (0.05, 0.02), (0.1, 0.02), (0.1, 0.2))


def check(mode: str, results: dict) -> None:
    plain = results[RUNS[0]]
    for key, got in results.items():
        report(mode, key, got)
        assert got["errors"] == []
        assert got["outputs"] == plain["outputs"]
        assert got["updates"] <= plain["updates"]


@pytest.mark.slow
def test_counts_in_process(tiny_model: str) -> None:
    from ragserve.generation import LLMEngine
    from ragserve.runtime.executors import LocalExecutor
    from ragserve.runtime.runners import GenerationRunner

    class NoRetrieval:
        def has_pending(self) -> bool:
            return False

    engine = LLMEngine(tiny_model, **ENGINE_KWARGS)
    serve(LocalExecutor(GenerationRunner(engine), NoRetrieval()), (), 0.02)  # warm-up
    results = {}
    for budget, poll_timeout in RUNS:
        executor = LocalExecutor(GenerationRunner(engine), NoRetrieval())
        transforms = () if budget is None else (SplitTransform(budget_s=budget),)
        results[budget, poll_timeout] = serve(executor, transforms, poll_timeout)
    check("in-process", results)


def process_executor(tiny_model: str, small_index: str):
    from ragserve.runtime import ServerConfig
    from ragserve.runtime.executors import ProcessExecutor
    from ragserve.runtime.workers import WorkerSpec

    gen = WorkerSpec(
        "generation", model=tiny_model, config=ServerConfig(engine_kwargs=ENGINE_KWARGS)
    )
    ret = WorkerSpec("retrieval", index=small_index)
    return ProcessExecutor(gen, ret, ServerConfig())


@pytest.mark.integration
def test_chunked_over_the_worker_process_equals_per_step(tiny_model: str, small_index: str):
    """The real generation worker (shared-memory token ids, stats on update messages): chunked
    tasks give the same outputs and token counts, in no more updates."""
    executor = process_executor(tiny_model, small_index)
    try:
        plain = serve(executor, (), 0.02, num_requests=8, num_tokens=24)
        chunked = serve(executor, (SplitTransform(budget_s=0.03),), 0.02, 8, 24)
    finally:
        executor.close()
    assert plain["errors"] == chunked["errors"] == []
    assert chunked["outputs"] == plain["outputs"]
    assert plain["updates"] == 8 * 24 and chunked["updates"] <= plain["updates"]
    assert executor.engine_stats()["running"] == 0  # the last stats came with the final updates


@pytest.mark.slow
@pytest.mark.integration
def test_counts_worker_process(tiny_model: str, small_index: str) -> None:
    executor = process_executor(tiny_model, small_index)
    worker = executor.workers["gen"]
    kinds: list[type] = []
    unpack = executor._unpack
    executor._unpack = lambda w, msg: (
        (kinds.append(type(msg)) if w is worker else None) or unpack(w, msg)
    )
    results = {}
    try:
        for budget, poll_timeout in RUNS:
            kinds.clear()
            transforms = () if budget is None else (SplitTransform(budget_s=budget),)
            got = results[budget, poll_timeout] = serve(executor, transforms, poll_timeout)
            got["gen_messages"], got["stats_messages"] = (
                kinds.count(GenerationResultsMsg),
                kinds.count(EngineStatsMsg),
            )
    finally:
        executor.close()
    check("worker-process", results)
