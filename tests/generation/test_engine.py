"""Engine behaviour: abort, seeded sampling, stop strings and tokens, over-long prompts."""

from __future__ import annotations

import pytest

from ragserve.generation import LLMEngine, PromptTooLongError, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = LLMEngine(
        tiny_models["llama"],
        device="cpu",
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=64 * 1024**2,
    )
    yield eng
    assert not eng.has_unfinished()
    eng.check_integrity()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def test_text_is_the_decoded_tokens_and_metrics_are_ordered(engine):
    (out,) = engine.generate([PROMPT], greedy(12))
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.prompt_token_ids == engine.tokenizer(PROMPT)["input_ids"]
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert engine.stats()["kv_blocks_used"] == 0


def test_abort_mid_decode_frees_every_block(engine):
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPT + rid, greedy(30))
    seen: dict[str, int] = {}
    while len(seen) < 3 or min(seen.values()) < 3:  # overlapped steps return a step late
        for out in engine.step():
            seen[out.request_id] = len(out.token_ids)
    assert seen == {"a": 3, "b": 3, "c": 3}
    used = engine.stats()["kv_blocks_used"]
    engine.abort("b")
    assert engine.stats()["kv_blocks_used"] < used
    engine.check_integrity()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "c"]
    engine.abort("a")
    engine.abort("c")
    engine.abort("never-added")  # ignored
    assert not engine.has_unfinished()
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0
    engine.check_integrity()


def test_abort_a_waiting_request(engine):
    engine.add_request("w", PROMPT, greedy(4))
    engine.abort("w")
    assert not engine.has_unfinished() and engine.step() == []


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=200, seed=7)
    (alone,) = engine.generate([PROMPT], params)
    # same seed again, now batched with other (unseeded, sampled) requests
    batch = engine.generate(
        [PROMPT, "Another prompt", PROMPT],
        [params, SamplingParams(max_tokens=5, temperature=1.0), params],
    )
    assert batch[0].token_ids == alone.token_ids == batch[2].token_ids
    (other,) = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=8))
    assert other.token_ids != alone.token_ids
    (g,) = engine.generate([PROMPT], greedy(16))
    (k1,) = engine.generate([PROMPT], greedy(16, temperature=1.0, top_k=1, seed=3))
    assert k1.token_ids == g.token_ids  # top_k=1 is greedy


def test_stop_string_cuts_the_text_exactly(engine):
    (full,) = engine.generate([PROMPT], greedy(24))
    text = full.text
    stop = text[10:14]
    cut = text.find(stop)
    (out,) = engine.generate([PROMPT], greedy(24, stop=("zzzz-not-there", stop)))
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_stop_token_ids(engine):
    (full,) = engine.generate([PROMPT], greedy(16))
    token = full.token_ids[5]
    first = full.token_ids.index(token)
    (out,) = engine.generate([PROMPT], greedy(16, stop_token_ids=(token,)))
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]


def test_eos_ends_generation_unless_ignored(tiny_models):
    eng = LLMEngine(tiny_models["llama"], device="cpu", kv_cache_bytes=16 * 1024**2)
    (full,) = eng.generate([PROMPT], greedy(16))
    eng.eos_token_ids = (full.token_ids[3],)  # pretend that token is EOS
    first = full.token_ids.index(full.token_ids[3])
    (out,) = eng.generate([PROMPT], SamplingParams(max_tokens=16))
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    (ignored,) = eng.generate([PROMPT], greedy(16))
    assert ignored.token_ids == full.token_ids


def test_over_long_prompt_rejected_without_disturbing_others(engine):
    (alone,) = engine.generate([PROMPT], greedy(10))
    engine.add_request("ok", PROMPT, greedy(10))
    engine.step()
    with pytest.raises(PromptTooLongError, match="64"):
        engine.add_request("long", list(range(100, 164)), greedy(4))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("ok", PROMPT, greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], greedy(4))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final.request_id == "ok" and final.token_ids == alone.token_ids


def test_generation_stops_at_the_context_end(engine):
    prompt = list(range(1000, 1060))  # 60 of 64 positions
    (out,) = engine.generate([prompt], greedy(10))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_chat_template_and_stats(engine):
    text = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text
    stats = engine.stats()
    assert {
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "preemptions",
        "prefix_cache_hit_tokens",
    } <= set(stats)
    assert stats["kv_blocks_total"] == engine.block_manager.num_blocks
    assert engine.max_model_len == 64


def test_kv_pool_sizing(tiny_models):
    from oracle_cases import pool_bytes

    path = tiny_models["llama"]
    eng = LLMEngine(path, device="cpu")  # CPU default: 32 full contexts of 512 tokens
    assert eng.stats()["kv_blocks_total"] * 16 == 32 * 512 and eng.max_model_len == 512
    small = pool_bytes(path, 10, 16)
    eng = LLMEngine(path, device="cpu", kv_cache_bytes=small)
    assert eng.max_model_len == 160  # an implicit context shrinks to the pool
    with pytest.raises(ValueError, match="KV pool holds 160 tokens"):
        LLMEngine(path, device="cpu", kv_cache_bytes=small, max_model_len=512)
