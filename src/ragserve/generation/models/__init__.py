"""Model implementations, looked up by Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from ragserve.generation.config import ModelConfig
from ragserve.generation.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    return _MODELS[config.architecture]


__all__ = ["LlamaForCausalLM", "get_model_class"]
