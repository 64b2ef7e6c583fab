"""Shared oracle workload: 8 prompts of mixed lengths (some sharing a prefix), added at
different steps, with their greedy continuations from ``transformers``."""

from __future__ import annotations

import random

import torch

from ragserve.generation import LLMEngine, ModelConfig, SamplingParams
from ragserve.generation.model_runner import kv_cache_bytes_per_block

# step index -> prompts added before that step
ADD_AT = {0: [0, 1, 2], 1: [3], 3: [4, 5], 4: [6], 7: [7]}
MAX_TOKENS = [8, 5, 10, 6, 8, 9, 7, 8]


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 49152) for _ in range(21)]
    lengths = [3, 30, 9, 17, 40, 1, 25, 12]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    # requests 3, 4 and 6 share a prefix with request 1 (hits once request 1 is computed)
    for i in (1, 3, 4, 6):
        prompts[i] = shared + prompts[i]
    return prompts


PROMPTS = _prompts()


def hf_greedy(model) -> list[list[int]]:
    """Greedy continuation of every prompt by ``transformers.generate`` (one at a time)."""
    runs = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
        runs.append(out[0, len(prompt) :].tolist())
    return runs


def run_staggered(engine: LLMEngine) -> dict[int, list[int]]:
    """Add the prompts at the steps of ``ADD_AT``, run to completion, check the pool is clean."""
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


def pool_bytes(path, num_blocks: int, block_size: int, dtype=torch.float32) -> int:
    """``kv_cache_bytes`` that gives exactly ``num_blocks`` blocks."""
    cfg = ModelConfig.from_folder(path)
    return num_blocks * kv_cache_bytes_per_block(cfg, block_size, dtype)
