"""The engine on CUDA: same greedy tokens as transformers (float32) with every attention
backend, chunked prefill, prefix hits and preemption; a bf16 dummy-weight smoke run."""

from __future__ import annotations

import json

import pytest
import torch
from oracle_cases import hf_greedy, pool_bytes, run_staggered

from ragserve.generation import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

SCENARIOS = {
    "chunked-prefix": dict(block_size=4, max_num_batched_tokens=7),
    "preempt": dict(block_size=4, max_model_len=72, enable_prefix_caching=False),
    "default": dict(),
}


@pytest.fixture(scope="module")
def expected(hf_oracles):
    return {arch: hf_greedy(model) for arch, model in hf_oracles.items()}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend", ["torch_ref", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_matches_transformers(arch, backend, scenario, tiny_models, expected):
    kwargs = dict(SCENARIOS[scenario])
    blocks = 18 if scenario == "preempt" else 256
    kwargs["kv_cache_bytes"] = pool_bytes(tiny_models[arch], blocks, kwargs.get("block_size", 16))
    engine = LLMEngine(
        tiny_models[arch], device="cuda", dtype="float32", attention_backend=backend, **kwargs
    )
    results = run_staggered(engine)
    assert [results[i] for i in range(len(results))] == expected[arch]
    if scenario == "preempt":
        assert engine.stats()["preemptions"] > 0


def test_bf16_dummy_weights_fill_free_memory(tmp_path):
    """A 1B-class Llama config with random bf16 weights: the KV pool is sized from free memory
    and a mixed batch runs to completion with every block returned."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "eos_token_id": 2,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(tmp_path, load_format="dummy", max_num_seqs=64)
    assert engine.config.dtype == "bfloat16" and engine.config.device.startswith("cuda")
    free, total = torch.cuda.mem_get_info()
    assert free < 0.25 * total  # the pool took most of what the weights left
    prompts = [[(7 * i + j) % 32000 for j in range(16 + 37 * i)] for i in range(48)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20] * 48
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_integrity()
