"""The idle integrity check off the step's critical path (``enable_deferred_integrity_check``):
same outputs as the inline check (the oracle), and a corrupted block table is still caught,
by ``run_deferred_checks`` or the next step."""

from __future__ import annotations

import pytest

from ragserve.generation import LLMEngine, SamplingParams

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was a"]


def _engine(path, deferred: bool) -> LLMEngine:
    return LLMEngine(
        path,
        device="cpu",
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=16 * 1024**2,
        enable_deferred_integrity_check=deferred,
    )


def _drive(engine: LLMEngine) -> list[tuple]:
    """Every step's outputs, request by request, until the engine is idle."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        seen += [(o.request_id, tuple(o.token_ids), o.text, o.finished) for o in engine.step()]
    return seen


def test_deferred_check_gives_the_inline_outputs(tiny_models):
    inline = _engine(tiny_models["llama"], deferred=False)
    deferred = _engine(tiny_models["llama"], deferred=True)
    assert _drive(deferred) == _drive(inline)
    assert deferred._integrity_due and not inline._integrity_due
    deferred.run_deferred_checks()
    assert not deferred._integrity_due
    deferred.check_integrity()


@pytest.mark.parametrize("by_next_step", [False, True])
def test_deferred_check_still_catches_corruption(tiny_models, by_next_step):
    engine = _engine(tiny_models["llama"], deferred=True)
    _drive(engine)  # idle now, its check due
    engine.block_manager.ref_cnt[0] += 1  # a leaked reference
    with pytest.raises(AssertionError, match="ref counts"):
        engine.step() if by_next_step else engine.run_deferred_checks()


def test_inline_check_raises_in_the_step_that_empties_the_engine(tiny_models):
    engine = _engine(tiny_models["llama"], deferred=False)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.block_manager.ref_cnt[engine.block_manager.num_blocks - 1] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        while engine.has_unfinished():
            engine.step()
