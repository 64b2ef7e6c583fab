"""ragserve.retrieval: corpus ingest, document store, embedder, Faiss IVF index with step-wise
search, and crash-safe online upsert.

Heavy modules (torch, transformers) load lazily: importing this package pulls in Faiss and
NumPy only.
"""

from __future__ import annotations

import importlib
from typing import Any

from ragserve.retrieval.index import IndexSpec, VectorIndex, auto_nlist
from ragserve.retrieval.storage import IndexCorruptError
from ragserve.retrieval.types import Document, ProbePlan, ScoredDocument, TopK

_LAZY = {
    "Embedder": "ragserve.retrieval.embedder",
    "load_embedder": "ragserve.retrieval.embedder",
    "DEFAULT_EMBEDDER": "ragserve.retrieval.embedder",
    "builtin_index": "ragserve.retrieval.builtin",
    "load_corpus": "ragserve.retrieval.corpus",
    "factbook_documents": "ragserve.retrieval.factbook",
    "BuildConfig": "ragserve.retrieval.build",
    "BuildError": "ragserve.retrieval.build",
    "BuildReport": "ragserve.retrieval.build",
    "build_index": "ragserve.retrieval.build",
}

__all__ = [
    "Document",
    "IndexCorruptError",
    "IndexSpec",
    "ProbePlan",
    "ScoredDocument",
    "TopK",
    "VectorIndex",
    "auto_nlist",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ragserve.retrieval' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
