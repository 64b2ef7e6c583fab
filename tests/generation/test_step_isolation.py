"""Step isolation (``step_isolation.py``): a step that raises for one request fails that
request alone; every other request's tokens equal those of a run without it (the oracle),
and the KV pool ends exactly free. Faults come through the real hooks: the documented
``$RAGSERVE_FAULT_INJECT`` check (``faults.py``) and the model runner's ``logits_hook``."""

from __future__ import annotations

import pytest

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.generation.faults import FAULT_ENV, STAGES, InjectedFault

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then it",
    "Paris is the capital of",
    "One, two, three, four,",
    "def fibonacci(n):",
]
POISON = "<poison>"


@pytest.fixture(scope="module")
def engine(tiny_models):
    # NOTE: prefix caching off so the oracle run and the run under test compute every token
    # the same way (a prefix hit reorders float sums; near-tied logits could flip a token).
    eng = LLMEngine(
        tiny_models["llama"],
        device="cpu",
        block_size=4,
        max_model_len=96,
        kv_cache_bytes=16 * 1024**2,
        enable_prefix_caching=False,
    )
    yield eng
    assert not eng.has_unfinished()
    eng.check_integrity()


def params(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def oracle(engine) -> list[list[int]]:
    """The innocent requests' greedy tokens, run together without any poison request."""
    return tokens_by_prompt(run(engine, innocents("o")), "o")


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add every request at once and step to the end; request id -> final output."""
    for rid, (prompt, p) in requests.items():
        engine.add_request(rid, prompt, p)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_integrity()
    return final


def innocents(tag: str, **kw) -> dict[str, tuple[str, SamplingParams]]:
    return {f"{tag}{i}": (p, params(**kw)) for i, p in enumerate(PROMPTS)}


def tokens_by_prompt(final: dict, tag: str) -> list[list[int]]:
    return [final[f"{tag}{i}"].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("stage", STAGES)
def test_a_poison_request_fails_alone_at_every_stage(engine, oracle, monkeypatch, stage) -> None:
    monkeypatch.setenv(FAULT_ENV, f"{stage}:{POISON}")
    poison = {"bad": ("Tell me a story about", params(stop=(POISON,)))}
    final = run(engine, {**innocents("i"), **poison})
    assert final["bad"].finish_reason == "error"
    assert InjectedFault.__name__ in final["bad"].error
    assert tokens_by_prompt(final, "i") == oracle
    assert all(final[f"i{i}"].finish_reason == "length" for i in range(len(PROMPTS)))


def test_a_fault_after_some_decode_steps_fails_only_then(engine, oracle) -> None:
    """The poison decodes normally for three steps, then its logits hook raises."""
    steps = {"n": 0}

    def hook(seqs, logits) -> None:
        if any(s.request_id == "late" for s in seqs):
            steps["n"] += 1
            if steps["n"] > 3:
                raise RuntimeError("probability tensor contains either inf, nan")

    engine.model_runner.logits_hook = hook
    try:
        final = run(engine, {**innocents("i"), "late": ("Once upon a time", params(20))})
    finally:
        engine.model_runner.logits_hook = None
    assert final["late"].finish_reason == "error"
    assert len(final["late"].token_ids) == 3  # its first three tokens were kept
    assert tokens_by_prompt(final, "i") == oracle


def test_several_culprits_each_fail_alone(engine, oracle, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, f"forward:{POISON},append:<also>")
    bad = {
        "bad1": ("Tell me", params(stop=(POISON,))),
        "bad2": ("Tell me more", params(stop=("<also>",))),
        "bad3": ("And more", params(stop=(POISON, "x"))),
    }
    final = run(engine, {**bad, **innocents("i")})
    assert [final[b].finish_reason for b in bad] == ["error"] * 3
    assert tokens_by_prompt(final, "i") == oracle


def test_seeded_sampling_draws_what_it_would_have_drawn(engine, monkeypatch) -> None:
    """The sampler's random state is rewound before each retry of the step."""
    sampled = {"temperature": 0.8, "top_p": 0.9}
    expected = run(engine, {f"o{i}": (p, params(seed=i, **sampled)) for i, p in enumerate(PROMPTS)})
    monkeypatch.setenv(FAULT_ENV, f"sample:{POISON}")
    final = run(
        engine,
        {
            **{f"i{i}": (p, params(seed=i, **sampled)) for i, p in enumerate(PROMPTS)},
            "bad": ("Tell me", params(seed=99, stop=(POISON,), **sampled)),
        },
    )
    assert final["bad"].finish_reason == "error"
    assert tokens_by_prompt(final, "i") == tokens_by_prompt(expected, "o")


def test_a_failure_no_single_request_causes_leaves_step(engine) -> None:
    """A batch-level failure (raises whenever more than one request is sampled) cannot be
    pinned on a request: ``step`` raises it, and aborting the requests frees every block."""

    def hook(seqs, logits) -> None:
        if len(seqs) > 1:
            raise MemoryError("out of memory for the batch")

    engine.model_runner.logits_hook = hook
    try:
        engine.add_request("a", PROMPTS[0], params())
        engine.add_request("b", PROMPTS[1], params())
        with pytest.raises(MemoryError):
            engine.step()
    finally:
        engine.model_runner.logits_hook = None
        engine.abort("a")
        engine.abort("b")
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_integrity()


def test_isolation_off_lets_the_step_raise(tiny_models, monkeypatch) -> None:
    eng = LLMEngine(
        tiny_models["llama"],
        device="cpu",
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=4 * 1024**2,
        enable_step_isolation=False,
    )
    monkeypatch.setenv(FAULT_ENV, f"append:{POISON}")
    eng.add_request("ok", PROMPTS[0], params())
    eng.add_request("bad", PROMPTS[1], params(stop=(POISON,)))
    with pytest.raises(InjectedFault):
        for _ in range(2):  # overlapped scheduling appends a step's tokens in the next call
            eng.step()
    eng.abort("ok")
    eng.abort("bad")
    assert eng.stats()["kv_blocks_used"] == 0
    eng.check_integrity()
