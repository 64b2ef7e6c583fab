"""The reranking plug point orders hits by the reranker's scores; the cross-encoder runner
equals the model's own logits (transformers as the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import Document, ScoredDocument
from ragserve.retrieval.rerank import BaseReranker, CrossEncoderReranker


class WordOverlap(BaseReranker):
    def score(self, query, texts):
        q = set(query.lower().split())
        return np.array([len(q & set(t.lower().split())) for t in texts], dtype=np.float32)


def _hits(texts):
    return [ScoredDocument(Document(f"d{i}", t), 1.0 - i / 10) for i, t in enumerate(texts)]


def test_rerank_orders_by_score_and_keeps_ties():
    hits = _hits(["alpha beta", "gamma", "alpha beta gamma", "beta", "delta"])
    out = WordOverlap().rerank("alpha beta gamma", hits, topk=4)
    assert [h.id for h in out] == ["d2", "d0", "d1", "d3"]
    assert [h.score for h in out] == [3.0, 2.0, 1.0, 1.0]
    assert WordOverlap().rerank("x", []) == []


def test_bad_reranker_output_is_rejected():
    class Broken(BaseReranker):
        def score(self, query, texts):
            return np.zeros(len(texts) + 1)

    with pytest.raises(ValueError, match="scores"):
        Broken().rerank("q", _hits(["a", "b"]))


def test_cross_encoder_equals_the_model(tmp_path):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ragserve.retrieval.embedder import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("all-minilm-l6-v2"))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=1,
    )  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    texts = ["Paris is the capital of France.", "Tea is a drink.", "Rivers flow to the sea."]
    reranker = CrossEncoderReranker(tmp_path, batch_size=2)
    got = reranker.score("capital of France", texts)
    enc = tok(["capital of France"] * 3, texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = model(**enc).logits[:, 0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="config.json"):
        CrossEncoderReranker(tmp_path / "missing")
