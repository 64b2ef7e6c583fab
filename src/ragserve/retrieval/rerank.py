"""Reranking: re-score a query's hits with a model that reads query and passage together
(docs/architecture.md, "Reranking plug point"). `BaseReranker` is the plug point;
`load_reranker` builds the one a configuration names (`OperatorConfig.reranker`)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ragserve.retrieval.types import ScoredDocument


class BaseReranker(ABC):
    """Scores (query, passage) pairs; higher is more relevant. `rerank` orders hits by it."""

    @abstractmethod
    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """float32 `[len(texts)]` relevance of each text to `query`."""

    def rerank(
        self, query: str, hits: Sequence[ScoredDocument], topk: int | None = None
    ) -> list[ScoredDocument]:
        """`hits` re-ordered by `score` (ties keep their order), cut to `topk`; each hit's
        score becomes the reranker's."""
        if not hits:
            return []
        texts = [f"{h.title}: {h.text}" if h.title else h.text for h in hits]
        scores = np.asarray(self.score(query, texts), dtype=np.float32)
        if scores.shape != (len(hits),):
            raise ValueError(f"reranker returned {scores.shape} scores for {len(hits)} hits")
        order = np.argsort(-scores, kind="stable")[:topk]
        return [ScoredDocument(hits[i].document, float(scores[i])) for i in order]


class CrossEncoderReranker(BaseReranker):
    """A cross-encoder (`AutoModelForSequenceClassification`, one logit per pair) from a local
    folder; pairs longer than `max_length` tokens are truncated (passage side first)."""

    def __init__(self, model_dir: str | Path, *, max_length: int = 512, batch_size: int = 32):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no cross-encoder model at {path} (config.json missing)")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        self.max_length = max_length
        self.batch_size = batch_size

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = np.zeros(len(texts), dtype=np.float32)
        with torch.inference_mode():
            for a in range(0, len(texts), self.batch_size):
                batch = list(texts[a : a + self.batch_size])
                enc = self.tokenizer(
                    [query] * len(batch),
                    batch,
                    padding=True,
                    truncation="only_second",
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**enc).logits.float()
                out[a : a + len(batch)] = logits[:, 0].cpu().numpy()
        return out


class EmbeddingReranker(BaseReranker):
    """The default scorer: the cosine similarity of query and passage under the index's own
    (unit-norm) embedder; it mostly re-orders hits from other sources (BM25, a function node)."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        q = np.asarray(self.embedder.encode([query], is_query=True), dtype=np.float32)
        d = np.asarray(self.embedder.encode(list(texts), is_query=False), dtype=np.float32)
        return (d @ q[0]).astype(np.float32)


EMBEDDING_RERANKER = "embedding"


class RerankerLoadError(ValueError):
    """A configured reranker cannot be built; the message is one line naming the spec."""


def reranker_factory(name: str) -> Any:
    """The callable ``"module:factory"`` names (imported now), or ``RerankerLoadError``."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise _load_error(name, f"expected {EMBEDDING_RERANKER!r} or 'module:factory'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise _load_error(name, f"cannot import {module_name} ({_one_line(exc)})") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise _load_error(name, f"{module_name} has no attribute {attr}")
        target = getattr(target, part)
    if not callable(target):
        raise _load_error(name, f"{attr} is a {type(target).__name__}, not callable")
    return target


def load_reranker(name: str, embedder: Any) -> Any:
    """``"embedding"``: `EmbeddingReranker(embedder)`; ``"module:factory"``: ``factory(embedder)``,
    which must have a callable ``score(query, texts)``. Failures: one-line `RerankerLoadError`."""
    if name == EMBEDDING_RERANKER:
        return EmbeddingReranker(embedder)
    factory = reranker_factory(name)
    try:
        reranker = factory(embedder)
    except Exception as exc:
        raise _load_error(name, f"the factory raised {_one_line(exc)}") from None
    if not callable(getattr(reranker, "score", None)):
        kind = type(reranker).__name__
        raise _load_error(
            name, f"the factory returned a {kind}, which has no score(query, texts) method"
        )
    return reranker


def _load_error(name: str, why: str) -> RerankerLoadError:
    return RerankerLoadError(f"reranker {name!r}: {why}")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
