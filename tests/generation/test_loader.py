"""Model folders: sharded checkpoints, random (dummy) weights, and clear errors naming the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ragserve.generation import LLMEngine, ModelLoadError, SamplingParams
from testing import make_tiny_model

PROMPT = list(range(500, 520))
KV = 8 * 1024**2


def greedy_tokens(folder, **kw) -> list[int]:
    engine = LLMEngine(folder, device="cpu", kv_cache_bytes=KV, **kw)
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    return out.token_ids


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], dst)
    return dst


def _shard(folder) -> None:
    """Split model.safetensors into two shards with an index, as HF does for big models."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_identically(model_copy, tiny_models):
    expected = greedy_tokens(tiny_models["qwen2"])
    _shard(model_copy)
    assert greedy_tokens(model_copy) == expected
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        greedy_tokens(model_copy)


def test_unknown_architecture_names_config(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json.*GPTNeoXForCausalLM"):
        greedy_tokens(model_copy)


def test_missing_weights_file(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weight files in .*model"):
        greedy_tokens(model_copy)


def test_corrupt_weights_file_is_named(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        greedy_tokens(model_copy)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        greedy_tokens(model_copy)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.safetensors.*layers.1.mlp.up_proj"):
        greedy_tokens(model_copy)


def test_dummy_weights_need_only_a_config(tmp_path, tiny_models):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", folder / "config.json")
    engine = LLMEngine(folder, device="cpu", kv_cache_bytes=KV, load_format="dummy", seed=3)
    assert engine.tokenizer is None
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("x", "text needs a tokenizer", SamplingParams())


@pytest.mark.parametrize(
    "arch, overrides",
    [
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        (
            "llama",
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "sliding_window": None,
            },
        ),
    ],
    ids=["llama3-rope", "mistral"],
)
def test_variants_match_transformers_logits(arch, overrides, tmp_path, session_home):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "m", arch, seed=5, **overrides)
    engine = LLMEngine(folder, device="cpu", kv_cache_bytes=KV)
    rows = []
    engine.model_runner.logits_hook = lambda seqs, logits: rows.append(logits[0].clone())
    prompt = list(range(700, 800))  # past the llama3 original context
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    oracle = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt + out.token_ids])).logits[0]
    for i, row in enumerate(rows):
        torch.testing.assert_close(row, ref[len(prompt) - 1 + i], atol=2e-4, rtol=1e-4)
    assert out.token_ids == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(3)]
