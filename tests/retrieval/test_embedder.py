"""The built-in embedder: shape, unit norm, order-independent batching, semantic sanity."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import load_embedder


@pytest.fixture(scope="module")
def embedder():
    return load_embedder("all-minilm-l6-v2")


def test_a_cpu_embedder_runs_in_fp32_unless_told(embedder):
    """fp32 on every CPU by default, bf16-capable ones included (bf16 cost 3 of 325 held-out
    answers in the top 5: BENCHMARKS.md, issue 14, session 10); an explicit dtype is kept."""
    import torch

    from ragserve.retrieval.embedder import _resolve_dtype

    assert embedder.device.type != "cpu" or embedder.model.dtype == torch.float32
    assert _resolve_dtype("auto", "cpu") == torch.float32
    assert _resolve_dtype("auto", "cuda") == torch.float16
    assert _resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_encode_shapes_norms_and_batching(embedder):
    texts = [
        "What is the capital of France?",
        "Paris is the capital of France.",
        "Bananas are rich in potassium.",
        "x",
    ]
    v = embedder.encode(texts, is_query=False)
    assert v.shape == (4, 384) and v.dtype == np.float32 and embedder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    one_by_one = np.concatenate([embedder.encode([t], is_query=False) for t in texts])
    np.testing.assert_allclose(one_by_one, v, atol=2e-2)
    assert v[0] @ v[1] > 0.6 > v[0] @ v[2]
    assert embedder.encode([], is_query=True).shape == (0, 384)


def test_prefixes_and_names(embedder, tmp_path):
    assert embedder.name == "all-minilm-l6-v2"
    assert (embedder.query_prefix, embedder.passage_prefix) == ("", "")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_embedder(str(tmp_path))
