"""Random-weight engines for the engine benches: Llama shapes (``LLAMA_31_8B`` and the tiny
``SMOKE`` override), a config-only model folder (``load_format="dummy"`` draws the weights at
load), and freeing one engine's device memory before the next is built."""

from __future__ import annotations

import gc
import json
from pathlib import Path

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}  # fmt: skip

SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def dummy_folder(root: Path, config: dict) -> Path:
    """A config-only model folder at ``root`` (random weights at load)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def free_device_memory() -> None:
    """Collect a dropped engine's cycles and return its CUDA blocks to the device, so that the
    next engine's KV pool fits."""
    import torch

    # NOTE: on CPU the next engine allocates host memory, which the automatic collector
    # reclaims; a full collection there costs ~0.2-0.5 s of a twin's (or a test's) run
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
