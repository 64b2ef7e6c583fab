"""Shared fixtures: small synthetic corpora with precomputed vectors (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import Document


def synthetic(n: int, dim: int = 16, seed: int = 0, prefix: str = "d"):
    """`n` documents with clustered unit vectors; returns (docs, vectors)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(8, dim))
    x = centers[rng.integers(0, 8, n)] + 0.5 * rng.normal(size=(n, dim))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    docs = [Document(f"{prefix}{i}", f"passage {prefix}{i}", f"T{i}", {"i": i}) for i in range(n)]
    return docs, x


@pytest.fixture
def make_corpus():
    """The `synthetic(n, dim=16, seed=0, prefix="d")` factory."""
    return synthetic


@pytest.fixture
def small_corpus():
    return synthetic(600)
