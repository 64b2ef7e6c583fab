"""Seeded random stress: many requests, a tiny KV pool and token budget, random arrivals and
aborts. Bookkeeping stays consistent every step, no request is lost, and every finished
request's greedy tokens equal those of the same request run alone in a roomy engine."""

from __future__ import annotations

import random

import pytest
from oracle_cases import pool_bytes

from ragserve.generation import LLMEngine, SamplingParams


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_random_arrivals_aborts_and_preemption(tiny_models, seed):
    path = tiny_models["qwen3"]
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(12)]
    requests = {}
    for i in range(16):
        own = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 20))]
        prompt = (shared[: rng.randrange(0, 13)] + own) if rng.random() < 0.6 else own
        requests[f"r{i}"] = (prompt, rng.randrange(1, 12))

    roomy = LLMEngine(path, device="cpu", block_size=4, kv_cache_bytes=pool_bytes(path, 512, 4))
    alone = {}
    for rid, (prompt, n) in requests.items():
        (out,) = roomy.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
        alone[rid] = out.token_ids

    engine = LLMEngine(
        path, device="cpu", block_size=4, max_num_batched_tokens=9, max_num_seqs=6,
        max_model_len=44, kv_cache_bytes=pool_bytes(path, 12, 4),
    )  # fmt: skip
    pending = list(requests)
    finished, aborted = {}, set()
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid = pending.pop(0)
                prompt, n = requests[rid]
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        live = [r for r in requests if r not in pending and r not in finished and r not in aborted]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = out.token_ids
        engine.check_integrity()
    assert aborted and set(finished) | aborted == set(requests)
    for rid, tokens in finished.items():
        assert tokens == alone[rid], rid
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["preemptions"] > 0
