"""Tokenizer prefetch: prompts tokenized on the prefetch thread, ahead of the engine step, give
exactly the outputs (text, token ids, prompt ids, errors) of tokenizing in the engine."""

from __future__ import annotations

import threading

import pytest

from ragserve.runtime.runners import GenerationRunner
from ragserve.scheduler import GenerationParams, GenerationTask

PARAMS = GenerationParams(max_tokens=6)


def tasks() -> list[GenerationTask]:
    return [
        GenerationTask("chat", "Tell me about Peru.", PARAMS),
        GenerationTask("history", "And Chile?", PARAMS, history=(("system", "Be brief."),)),
        GenerationTask("text", "The capital of Chile is", PARAMS, chat=False),
        GenerationTask("ids", (5, 17, 42, 9), PARAMS, chat=False),
        GenerationTask("empty", (), PARAMS, chat=False),  # rejected by the engine
        GenerationTask("stop", "What is RAG?", GenerationParams(max_tokens=8, stop=("e",))),
    ]


@pytest.fixture(scope="module")
def engine(tiny_model: str):
    from ragserve.generation import LLMEngine

    # NOTE: prefix caching off: both runs must compute the same logits in the same order.
    return LLMEngine(tiny_model, device="cpu", enable_prefix_caching=False)


def run(engine, prefetch: bool) -> dict[str, tuple]:
    """Each task's assembled output: (text, token ids, prompt ids, finish reason, error)."""
    runner = GenerationRunner(engine, tokenizer_prefetch=prefetch)
    updates = list(runner.add(tasks()))
    while runner.has_work():
        updates.extend(runner.step())
    runner.close()
    out: dict[str, list] = {}
    for u in updates:
        out.setdefault(u.task_id, []).append(u)
    return {
        tid: (
            "".join(u.text_delta for u in us),
            tuple(t for u in us for t in u.new_token_ids),
            [u.prompt_token_ids for u in us if u.prompt_token_ids is not None],
            us[-1].finish_reason,
            us[-1].error,
        )
        for tid, us in out.items()
    }


def test_prefetch_on_and_off_give_identical_outputs(engine, monkeypatch) -> None:
    threads: list[str] = []
    tokenize = engine.tokenize

    def recording(prompt: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return tokenize(prompt)

    monkeypatch.setattr(engine, "tokenize", recording)
    with_prefetch = run(engine, prefetch=True)
    assert threads and all(name.startswith("ragserve-tokenize") for name in threads)
    threads.clear()
    assert run(engine, prefetch=False) == with_prefetch
    assert threads == []  # without prefetch the engine tokenizes the text itself
    assert sorted(with_prefetch) == sorted(t.task_id for t in tasks())
    assert with_prefetch["empty"][4] is not None and "empty prompt" in with_prefetch["empty"][4]
    chat = engine.apply_chat_template([{"role": "user", "content": "Tell me about Peru."}])
    assert with_prefetch["chat"][2] == [tuple(tokenize(chat))]
    assert with_prefetch["ids"][2] == [(5, 17, 42, 9)]
    assert not engine.has_unfinished()


def test_a_task_aborted_while_tokenizing_never_reaches_the_engine(engine) -> None:
    runner = GenerationRunner(engine, tokenizer_prefetch=True)
    try:
        runner.add(tasks()[:2])
        runner.abort(["chat"])
        updates = []
        while runner.has_work():
            updates.extend(runner.step())
        assert {u.task_id for u in updates} == {"history"}
        assert updates[-1].finished and not engine.has_unfinished()
    finally:
        runner.close()
