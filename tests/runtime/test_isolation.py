"""One request never fails another inside the workers' code (``runners.py``): a batch that
raises is retried without the task that broke it; a task the real engine fails alone in a
step gets an error update while the others finish as they would have without it; an engine
step that still raises fails the tasks it held and leaves the engine usable; a task that
cannot be pickled fails alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ragserve.graph import Passage
from ragserve.runtime.runners import GenerationRunner
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner, run_isolated
from ragserve.scheduler import GenerationParams, GenerationTask, RetrievalTask
from ragserve.workflows import get_workflow

SHORT = get_workflow("oneshot", max_tokens=6)  # the built-in, with a short answer


class PickyEmbedder:
    """Fails a whole batch when any query holds ``"poison"``, as a tokenizer does."""

    def __init__(self) -> None:
        self.num_calls = 0

    def encode(self, texts, is_query=False):
        self.num_calls += 1
        if any("poison" in t for t in texts):
            raise TypeError("TextEncodeInput must be Union[...]")
        return np.ones((len(texts), 4), np.float32)


class OneDocIndex:
    def search(self, vectors, k, **_):
        from ragserve.retrieval import TopK

        n = len(vectors)
        return TopK(np.zeros((n, k), np.int64), np.ones((n, k), np.float32))

    def get_documents(self, ids):
        from ragserve.retrieval import Document

        return [Document("d0", "text", "T") for _ in ids]


def test_a_poison_query_fails_alone_and_the_batch_is_retried() -> None:
    runner = StagedRetrievalRunner(OneDocIndex(), PickyEmbedder())
    tasks = [RetrievalTask(f"t{i}", "poison" if i == 2 else f"q{i}", 1) for i in range(5)]
    results = run_isolated(runner, tasks)
    by_id = {r.task_id: r for r in results}
    assert sorted(by_id) == [t.task_id for t in tasks]
    assert by_id["t2"].error is not None and by_id["t2"].error_kind == "bad_request"
    for i in (0, 1, 3, 4):
        assert by_id[f"t{i}"].error is None
        assert by_id[f"t{i}"].passages == (Passage("d0", "text", "T", 1.0),)


def test_a_healthy_batch_runs_once_as_a_batch() -> None:
    embedder = PickyEmbedder()
    runner = StagedRetrievalRunner(OneDocIndex(), embedder)
    tasks = [RetrievalTask("a", "q", 1), RetrievalTask("b", "r", 1)]
    results = run_isolated(runner, tasks)
    assert [r.error for r in results] == [None, None] and embedder.num_calls == 1


class FlakyEngine:
    """A stand-in ``LLMEngine`` whose next ``step`` raises when ``fail`` is set."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.fail = False

    def add_request(self, rid, prompt, params, *, fusion_ratio=None):
        if "\ud800" in prompt:
            raise TypeError("TextEncodeInput must be Union[...]")
        self.requests[rid] = params

    def apply_chat_template(self, messages):
        return messages[0]["content"]

    def abort(self, rid):
        self.requests.pop(rid, None)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("probability tensor contains either inf, nan")
        return []


def test_a_task_the_tokenizer_rejects_fails_alone() -> None:
    runner = GenerationRunner(FlakyEngine())
    params = GenerationParams(max_tokens=2)
    errors = runner.add(
        [GenerationTask("bad", "What \ud800 is", params), GenerationTask("ok", "Hi", params)]
    )
    assert [(u.task_id, u.error_kind) for u in errors] == [("bad", "bad_request")]
    assert runner.has_work()


def test_a_failed_engine_step_fails_its_tasks_and_the_engine_goes_on() -> None:
    engine = FlakyEngine()
    runner = GenerationRunner(engine)
    params = GenerationParams(max_tokens=2)
    runner.add([GenerationTask("a", "x", params), GenerationTask("b", "y", params)])
    engine.fail = True
    failed = runner.step()
    assert sorted(u.task_id for u in failed) == ["a", "b"]
    assert all(u.finished and u.error_kind == "internal" for u in failed)
    assert "inf, nan" not in failed[0].error  # details stay in the worker's log
    assert not engine.has_unfinished()  # aborted: their blocks are free
    runner.add([GenerationTask("c", "z", params)])
    assert runner.step() == [] and engine.has_unfinished()


def run_to_end(runner: GenerationRunner, tasks: list[GenerationTask]) -> dict:
    """task id -> its final update (error or finished), through ``add`` and ``step``."""
    final = {u.task_id: u for u in runner.add(tasks)}
    while runner.has_work():
        final.update((u.task_id, u) for u in runner.step() if u.finished)
    return final


def test_a_task_the_engine_fails_in_a_step_fails_alone(tiny_model, monkeypatch) -> None:
    """A real engine whose forward pass raises for one task (``$RAGSERVE_FAULT_INJECT``): that
    task ends with an ``internal`` error, the others with the text of a run without it."""
    from ragserve.generation import LLMEngine
    from ragserve.generation.faults import FAULT_ENV

    engine = LLMEngine(
        tiny_model, device="cpu", kv_cache_bytes=8 * 1024**2, enable_prefix_caching=False
    )
    runner = GenerationRunner(engine)
    params = GenerationParams(max_tokens=6, ignore_eos=True)
    prompts = ["The capital of Peru is", "Hello there", "One two three"]
    oracle = run_to_end(runner, [GenerationTask(f"o{i}", p, params) for i, p in enumerate(prompts)])
    monkeypatch.setenv(FAULT_ENV, "forward:<poison>")
    poison = GenerationParams(max_tokens=6, stop=("<poison>",))
    tasks = [GenerationTask(f"i{i}", p, params) for i, p in enumerate(prompts)]
    final = run_to_end(runner, [tasks[0], GenerationTask("bad", "Tell me", poison), *tasks[1:]])
    assert final["bad"].error_kind == "internal" and "InjectedFault" not in final["bad"].error
    assert [final[f"i{i}"].final_text for i in range(3)] == [
        oracle[f"o{i}"].final_text for i in range(3)
    ]
    assert [final[f"i{i}"].error for i in range(3)] == [None] * 3
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_integrity()


def test_surrogate_question_fails_alone_in_process(local_server) -> None:
    async def together():
        bad = local_server.submit("What \ud800 is Python?", SHORT)
        good = [local_server.submit(f"What is the capital of Peru? {i}", SHORT) for i in range(3)]
        return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(asyncio.wait_for(together(), 120))
    assert bad.error_kind == "bad_request"
    assert [r.error for r in good] == [None] * 3


def test_bad_sampling_never_reaches_a_worker() -> None:
    with pytest.raises(ValueError, match="seed"):
        GenerationParams(seed=2**64)
    with pytest.raises(ValueError, match="temperature"):
        GenerationParams(temperature=float("nan"))
