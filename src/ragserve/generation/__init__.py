"""ragserve's LLM engine: Llama-family models, paged KV cache, continuous batching.

Public: ``LLMEngine``, ``SamplingParams``, ``RequestOutput`` (see ``docs/architecture.md``).
"""

from ragserve.generation.config import EngineConfig, ModelConfig, ModelLoadError, PromptTooLongError
from ragserve.generation.llm_engine import LLMEngine
from ragserve.generation.sampling_params import SamplingParams
from ragserve.generation.segments import Segment
from ragserve.generation.sequence import RequestMetrics, RequestOutput

__all__ = [
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Segment",
]
