"""Reading Hugging Face configs: rope variants, sliding windows, EOS ids, bad configs."""

from __future__ import annotations

import pytest

from ragserve.generation import EngineConfig, ModelConfig, ModelLoadError
from ragserve.generation.engine_setup import resolve_max_model_len

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


def test_llama3_legacy_rope_scaling_and_eos_list():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 500000.0,
            "rope_scaling": rope,
            "eos_token_id": [128001, 128009],
        }
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == rope
    assert cfg.eos_token_ids == (128001, 128009) and cfg.head_dim == 16
    assert not cfg.attention_bias and not cfg.qk_norm


def test_transformers5_rope_parameters():
    cfg = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen3ForCausalLM"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    )
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {} and cfg.qk_norm


def test_sliding_window_caps_the_context():
    mistral = ModelConfig.from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert resolve_max_model_len(EngineConfig(model="m"), mistral) == 4096
    with pytest.raises(ValueError, match="exceeds"):
        resolve_max_model_len(EngineConfig(model="m", max_model_len=5000), mistral)
    qwen2 = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert qwen2.sliding_window is None and qwen2.attention_bias
    assert resolve_max_model_len(EngineConfig(model="m"), qwen2) == 8192


def test_bad_configs_name_the_file():
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        ModelConfig.from_dict({**BASE, "architectures": ["BertModel"]})
    with pytest.raises(ModelLoadError, match="malformed"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]}, source="x/config.json")


def test_unsupported_rope_type_is_an_error(tmp_path):
    from ragserve.generation.llama import rope_inv_freq

    with pytest.raises(ModelLoadError, match="yarn"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
