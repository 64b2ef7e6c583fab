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


@torch.no_grad()
def hf_greedy_one(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of one prompt by the ``transformers`` model (its own KV cache; the
    tokens ``generate(do_sample=False)`` gives, without its per-call machinery)."""
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == max_tokens:
            return tokens
        step = torch.tensor([[tokens[-1]]], device=model.device)
        out = model(step, past_key_values=out.past_key_values, use_cache=True)


def hf_greedy(model) -> list[list[int]]:
    """Greedy continuation of every prompt by ``transformers`` (one at a time)."""
    return [hf_greedy_one(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


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
