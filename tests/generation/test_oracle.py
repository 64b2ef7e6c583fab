"""Greedy tokens and logits of our engine equal transformers' on seeded tiny models.

Each scenario stresses one mechanism: requests arriving mid-run, chunked prefill under a
tiny token budget, prefix-cache hits on shared prefixes, and preemption in a tiny KV pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.generation.model_runner import kv_cache_bytes_per_block

ARCHS = ("llama", "qwen2", "qwen3")
# step index -> prompts added before that step
ADD_AT = {0: [0, 1, 2], 1: [3], 3: [4, 5], 4: [6], 7: [7]}


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 49152) for _ in range(21)]
    lengths = [3, 30, 9, 17, 40, 1, 25, 12]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    # requests 3, 4 and 6 share a prefix with request 1 (hits once request 1 is computed)
    for i in (3, 4, 6):
        prompts[i] = shared + prompts[i]
    prompts[1] = shared + prompts[1]
    return prompts


PROMPTS = _prompts()
MAX_TOKENS = [8, 5, 10, 6, 8, 9, 7, 8]


@pytest.fixture(scope="module")
def expected(hf_oracles):
    """arch -> greedy continuation of every prompt by ``transformers.generate``."""
    out = {}
    for arch, model in hf_oracles.items():
        runs = []
        for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
            runs.append(ids[0, len(prompt) :].tolist())
        out[arch] = runs
    return out


def run_staggered(engine: LLMEngine) -> dict[int, list[int]]:
    """Add the prompts at the steps of ``ADD_AT`` and run to completion."""
    results: dict[int, list[int]] = {}
    step = 0
    while step <= max(ADD_AT) or engine.has_unfinished():
        for i in ADD_AT.get(step, []):
            params = SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True)
            engine.add_request(str(i), PROMPTS[i], params)
        for output in engine.step():
            if output.finished:
                assert output.finish_reason == "length"
                results[int(output.request_id)] = output.token_ids
        step += 1
    engine.check_integrity()
    assert engine.stats()["kv_blocks_used"] == 0
    return results


def _pool_bytes(path, num_blocks: int, block_size: int) -> int:
    from ragserve.generation import ModelConfig

    cfg = ModelConfig.from_folder(path)
    return num_blocks * kv_cache_bytes_per_block(cfg, block_size, torch.float32)


SCENARIOS = {
    "staggered": dict(block_size=16, enable_prefix_caching=False),
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    "prefix": dict(block_size=4),
    "preempt": dict(block_size=4, max_model_len=72, enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, scenario, tiny_models, expected):
    kwargs = dict(SCENARIOS[scenario])
    if scenario == "preempt":
        kwargs["kv_cache_bytes"] = _pool_bytes(tiny_models[arch], 18, 4)  # 72 tokens
    else:
        kwargs["kv_cache_bytes"] = _pool_bytes(tiny_models[arch], 256, kwargs["block_size"])
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
        kv_cache_bytes=_pool_bytes(tiny_models[arch], 256, 4),
    )
    captured: dict[tuple[str, int], torch.Tensor] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits, strict=True):
            captured[(seq.request_id, seq.num_tokens - 1)] = row.clone()

    engine.model_runner.logits_hook = hook
    run_staggered(engine)
    assert len(captured) == sum(MAX_TOKENS)
    model = hf_oracles[arch]
    for i, prompt in enumerate(PROMPTS):
        full = torch.tensor([prompt + expected[arch][i]])
        with torch.no_grad():
            ref = model(full).logits[0]
        for pos in range(len(prompt) - 1, full.shape[1] - 1):
            torch.testing.assert_close(captured[(str(i), pos)], ref[pos], atol=2e-4, rtol=1e-4)
