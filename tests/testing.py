"""Test support shared by tests/ and bench/ (``from testing import ...``: pytest puts tests/ on
the path; bench scripts insert it): seeded tiny random models with a real tokenizer, and the
Triton interpreter runner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# Tiny but complete: GQA (4 heads over 2 KV heads), several layers, the real SmolLM2 vocabulary.
_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.5,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": 49152,
}
_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a seeded random model folder (config, safetensors, tokenizer) at ``path``.

    ``overrides`` replace config fields (e.g. ``num_hidden_layers=4``). The same arguments
    always give the same weights. The tokenizer is SmolLM2's (converted once per
    ``$RAGSERVE_HOME``), so real text prompts and its chat template work.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; use one of {sorted(_ARCHS)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragserve.generation.builtin import builtin_tokenizer_dir

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**_BASE, **_ARCHS[arch], **overrides}
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zeroes biases and sets norms to 1: perturb them so they count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]})
    )
    tok_dir = builtin_tokenizer_dir()
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
    return out


def run_in_triton_interpreter(test_dir: str | Path, code: str, timeout: float = 300) -> None:
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (Triton reads it when a
    kernel is decorated, so it must be set before the kernel modules are imported) and
    ``test_dir`` on the path; raise ``AssertionError`` with the end of its stderr if it fails.
    The CPU twin of the Triton kernels' CUDA tests."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(test_dir), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
