"""ragserve: a RAG serving engine that co-schedules LLM generation and vector retrieval.

The public API is re-exported here lazily, so that ``from ragserve import RAGraph`` does not
import torch or faiss.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RAGraph": "ragserve.graph",
    "START": "ragserve.graph",
    "END": "ragserve.graph",
    "Server": "ragserve.runtime",
    "ServerConfig": "ragserve.runtime",
    "CoScheduleConfig": "ragserve.runtime",
    "OperatorConfig": "ragserve.runtime",
    "Response": "ragserve.runtime",
    "LLMEngine": "ragserve.generation",
    "SamplingParams": "ragserve.generation",
    "RequestOutput": "ragserve.generation",
    "VectorIndex": "ragserve.retrieval",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ragserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
