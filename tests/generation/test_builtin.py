"""The built-in SmolLM2-135M-Instruct: converted once from the packaged GGUF, and our greedy
output equals transformers' on chat prompts."""

from __future__ import annotations

import pytest
import torch

from ragserve.generation import LLMEngine, ModelLoadError, SamplingParams
from ragserve.generation.builtin import ensure_builtin, resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a vector index is in one sentence.",
    "List three prime numbers.",
]


def test_unknown_model_name_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a folder nor a built-in name"):
        resolve_model("no-such-model-xyz")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine(tmp_path, device="cpu")


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(session_home):
    from transformers import AutoModelForCausalLM

    engine = LLMEngine("smollm2-135m-instruct", device="cpu", kv_cache_bytes=256 * 1024**2)
    folder = engine.model_dir
    mtime = (folder / "model.safetensors").stat().st_mtime
    assert ensure_builtin("smollm2-135m-instruct") == folder  # reused, not re-converted
    assert (folder / "model.safetensors").stat().st_mtime == mtime
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24))

    oracle = AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
        assert out.prompt_token_ids == ids[0].tolist()
        ref = oracle.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == 2 else "length")
    assert any(out.text.strip() for out in outputs)
