"""Greedy tokens and logits of our engine equal transformers' on seeded tiny models.

Each scenario stresses one mechanism: requests arriving mid-run, chunked prefill under a
tiny token budget, prefix-cache hits on shared prefixes, and preemption in a tiny KV pool.
The scenarios run on llama; every architecture's tokens and logits (prefix caching on) are
checked against transformers in ``test_logits_close_to_transformers``.
"""

from __future__ import annotations

import pytest
import torch
from oracle_cases import MAX_TOKENS, PROMPTS, hf_greedy, pool_bytes, run_staggered

from ragserve.generation import LLMEngine

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def expected(hf_oracles):
    """arch -> greedy continuation of every prompt by ``transformers.generate``."""
    return {arch: hf_greedy(model) for arch, model in hf_oracles.items()}


SCENARIOS = {
    "staggered": dict(block_size=16, enable_prefix_caching=False),
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    "prefix": dict(block_size=4),
    "preempt": dict(block_size=4, max_model_len=72, enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(scenario, tiny_models, expected):
    arch = "llama"
    kwargs = dict(SCENARIOS[scenario])
    if scenario == "preempt":
        kwargs["kv_cache_bytes"] = pool_bytes(tiny_models[arch], 18, 4)  # 72 tokens
    else:
        kwargs["kv_cache_bytes"] = pool_bytes(tiny_models[arch], 256, kwargs["block_size"])
    engine = LLMEngine(tiny_models[arch], device="cpu", **kwargs)
    results = run_staggered(engine)
    assert [results[i] for i in range(len(PROMPTS))] == expected[arch]
    stats = engine.stats()
    if scenario == "prefix":
        assert stats["prefix_cache_hit_tokens"] >= 3 * 20  # 5 shared blocks, 3 requests
    if scenario == "preempt":
        assert stats["preemptions"] > 0
    if scenario == "staggered":
        assert stats["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_close_to_transformers(arch, tiny_models, hf_oracles, expected):
    engine = LLMEngine(
        tiny_models[arch],
        device="cpu",
        block_size=4,
        kv_cache_bytes=pool_bytes(tiny_models[arch], 256, 4),
    )
    captured: dict[tuple[str, int], torch.Tensor] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits, strict=True):
            # NOTE: overlapped scheduling runs the hook before the last step's token is on
            # the host; the row's position counts that pending token
            captured[(seq.request_id, seq.num_tokens + seq.num_pending_tokens - 1)] = row.clone()

    engine.model_runner.logits_hook = hook
    results = run_staggered(engine)
    assert [results[i] for i in range(len(PROMPTS))] == expected[arch]
    assert len(captured) == sum(MAX_TOKENS)
    model = hf_oracles[arch]
    for i, prompt in enumerate(PROMPTS):
        full = torch.tensor([prompt + expected[arch][i]])
        with torch.no_grad():
            ref = model(full).logits[0]
        for pos in range(len(prompt) - 1, full.shape[1] - 1):
            torch.testing.assert_close(captured[(str(i), pos)], ref[pos], atol=2e-4, rtol=1e-4)
