"""Document-KV reuse is exact: greedy outputs with reuse off, the knowledge tree on the GPU
only, and GPU + host (a tiny GPU pool forces swaps) all equal ``transformers``' greedy
continuations, for RAG prompts sharing (and shuffling) documents, arriving staggered."""

from __future__ import annotations

import random

import pytest
from oracle_cases import hf_greedy_one, pool_bytes

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.generation.engine_setup import load_tokenizer

MAX_TOKENS = 5
WORDS = [
    "river",
    "stone",
    "market",
    "city",
    "winter",
    "harbor",
    "coal",
    "wheat",
    "census",
    "border",
    "mountain",
    "tariff",
]


def _requests() -> list[tuple[list[int], str]]:
    """(document indices in prompt order, question) for 10 requests over 6 documents."""
    return [
        ([0, 1, 2], "Which river?"),
        ([0, 1, 2], "Which city?"),  # same documents, new question
        ([0, 1, 3], "Which port?"),  # shares the first two
        ([2, 0, 1], "Which river?"),  # shuffled: only the instructions are shared
        ([4, 5, 0], "What grows?"),
        ([0, 1, 2], "Which river?"),  # a repeat of the first prompt
        ([4, 5, 1], "What border?"),
        ([3, 1, 0], "How cold?"),
        ([0, 1, 3], "Which tariff?"),
        ([4, 5, 0], "What grows here?"),
    ]


def _prompt(docs: list[str], order: list[int], question: str) -> str:
    passages = "\n\n".join(f"[{i}] Doc {d}\n{docs[d]}" for i, d in enumerate(order, 1))
    return f"Use the passages to answer the question.\n\n{passages}\n\nQuestion: {question}"


@pytest.fixture(scope="module")
def prompts(tiny_models) -> list[list[int]]:
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(25, 45))) for _ in range(6)]
    tok = load_tokenizer(tiny_models["llama"])  # the engines' own (shared) tokenizer
    return [tok(_prompt(docs, o, q))["input_ids"] for o, q in _requests()]


@pytest.fixture(scope="module")
def expected(hf_oracles, prompts) -> dict[str, list[list[int]]]:
    out = {}
    for arch in ("llama", "qwen2"):
        model = hf_oracles[arch]
        out[arch] = [hf_greedy_one(model, p, MAX_TOKENS) for p in prompts]
    return out


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Two requests arrive per step; integrity is checked after every step."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, list[int]] = {}
    step = 0
    while step * 2 < len(prompts) or engine.has_unfinished():
        for i in range(step * 2, min(step * 2 + 2, len(prompts))):
            engine.add_request(str(i), prompts[i], params)
        for output in engine.step():
            if output.finished:
                results[int(output.request_id)] = output.token_ids
        engine.check_integrity()
        step += 1
    return [results[i] for i in range(len(prompts))]


CONFIGS = {
    "off": dict(enable_prefix_caching=False, num_blocks=96),
    "blocks": dict(enable_knowledge_tree=False, num_blocks=96),
    "tree_gpu": dict(num_blocks=96),
    "tree_host_pgdsf": dict(num_blocks=24, host_blocks=64),
    "tree_host_lru": dict(num_blocks=24, host_blocks=64, kv_eviction_policy="lru"),
    "tree_tiny_host": dict(num_blocks=24, host_blocks=6, enable_cache_aware_scheduling=False),
}
# the host tier's paths, on one architecture (the model code is the same as above)
SWAP_CONFIGS = {
    # (the configurations above overlap swap-ins with the running step: the default)
    "no_overlap": dict(num_blocks=24, host_blocks=64, overlap_swap_in=False),
    # swap-outs blocking (the oracle of the asynchronous ones, on by default above)
    "sync_swap_out": dict(num_blocks=24, host_blocks=64, async_swap_out=False),
    # swapping costs more than recomputing: host hits are recomputed instead
    "recompute": dict(num_blocks=24, host_blocks=64, swap_cost=1e9),
    # a pool of about one prompt: requests are preempted and come back through the host
    "preempt": dict(num_blocks=16, host_blocks=64, enable_cache_aware_scheduling=False),
}


# every configuration on llama; one on qwen2 (qkv bias, tied embeddings: the model differs,
# the cache code does not)
ARCH_CONFIGS = [("llama", c) for c in CONFIGS] + [("qwen2", "tree_host_pgdsf")]


@pytest.mark.parametrize(("arch", "config"), ARCH_CONFIGS)
def test_reuse_matches_transformers(arch, config, tiny_models, prompts, expected):
    kw = dict(CONFIGS[config])
    path = tiny_models[arch]
    kw["kv_cache_bytes"] = pool_bytes(path, kw.pop("num_blocks"), 16)
    host_blocks = kw.pop("host_blocks", 0)
    kw["host_kv_cache_bytes"] = pool_bytes(path, host_blocks, 16)
    engine = LLMEngine(path, device="cpu", max_model_len=384, **kw)
    assert run(engine, prompts) == expected[arch]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0
    if config == "off":
        assert stats["num_gpu_hit_tokens"] == 0
    else:
        assert stats["num_gpu_hit_tokens"] >= 100
    if host_blocks:
        assert stats["num_swapped_out_blocks"] > 0 and stats["num_host_hit_tokens"] > 0
        assert stats["num_swapped_in_blocks"] * 16 == stats["num_host_hit_tokens"]
        assert stats["num_swap_out_bytes"] == stats["num_swapped_out_blocks"] * pool_bytes(
            path, 1, 16
        )


@pytest.mark.parametrize("config", list(SWAP_CONFIGS))
def test_host_tier_paths_match_transformers(config, tiny_models, prompts, expected):
    kw = dict(SWAP_CONFIGS[config])
    path = tiny_models["llama"]
    kw["kv_cache_bytes"] = pool_bytes(path, kw.pop("num_blocks"), 16)
    kw["host_kv_cache_bytes"] = pool_bytes(path, kw.pop("host_blocks"), 16)
    swap_cost = kw.pop("swap_cost", None)
    engine = LLMEngine(path, device="cpu", max_model_len=256, **kw)
    if swap_cost is not None:
        engine.block_manager.swap_cost_fn = lambda n: swap_cost * n
    assert run(engine, prompts) == expected["llama"]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_swapped_out_blocks"] > 0
    if config == "recompute":
        assert stats["num_host_hit_tokens"] == 0 and stats["num_swap_skipped_blocks"] > 0
        return
    assert stats["num_host_hit_tokens"] > 0 and stats["num_swap_skipped_blocks"] == 0
    if config == "preempt":
        assert stats["preemptions"] > 0
    if config == "no_overlap":
        assert stats["num_deferred_swap_ins"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_reuse_with_host_tier_matches_full_prefill():
    """Real weights: the tree with a tiny GPU pool and a host tier answers exactly as full
    prefill does (greedy, the same RAG prompts)."""
    from transformers import AutoTokenizer

    from ragserve.generation.builtin import resolve_model

    folder = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(3)
    docs = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(6)]
    prompts = [tok(_prompt(docs, o, q))["input_ids"] for o, q in _requests()]
    per_block = pool_bytes(folder, 1, 16)
    common = dict(device="cpu", max_model_len=384, cpu_threads=1)
    full = LLMEngine(folder, enable_prefix_caching=False, kv_cache_bytes=64 * per_block, **common)
    tiered = LLMEngine(
        folder, kv_cache_bytes=24 * per_block, host_kv_cache_bytes=64 * per_block, **common
    )
    assert run(tiered, prompts) == run(full, prompts)
    stats = tiered.stats()
    # the tiny pool pushes blocks out to the host (swap-ins are asserted by the tiny models)
    assert stats["num_swapped_out_blocks"] > 0 and stats["num_gpu_hit_tokens"] > 0


def test_explicit_segment_ends_make_the_nodes(tiny_models):
    engine = LLMEngine(tiny_models["llama"], device="cpu", block_size=4, max_model_len=128)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    ids = list(range(100, 124))
    for bad in ([], [10, 10, 24], [0, 24], [10, 23], [30]):
        with pytest.raises(ValueError, match="segment_ends"):
            engine.add_request("r", ids, params, segment_ends=bad)
    assert not engine.has_unfinished()
    engine.add_request("r", ids, params, segment_ends=[8, 20, 24])
    while engine.has_unfinished():
        engine.step()
    engine.generate([ids[:20] + [7, 8, 9]], params)  # shares r's first two segments
    nodes = sorted((n.start, n.num_tokens, n.freq) for n in engine.block_manager.nodes.values())
    # r made [0, 8) [8, 20) [20, 24); the second prompt hit 20 tokens (both nodes used twice)
    # and its own block [20, 24) went to its single detected segment [0, 23)
    assert nodes == [(0, 8, 2), (0, 23, 1), (8, 12, 2), (20, 4, 1)]
    assert engine.stats()["num_gpu_hit_tokens"] == 20
    engine.check_integrity()
