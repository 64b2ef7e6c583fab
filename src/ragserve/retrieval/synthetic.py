"""The synthetic embedder of benchmark indexes (corpus: ``bench/synthetic_corpus.py``).

``SyntheticEmbedder`` maps text to a unit vector deterministically: the text's first line
picks a Zipf-skewed topic (seeded by its hash), the whole text adds noise, so queries that
repeat the question stay near each other. Its ``name`` encodes the spec, so
``load_embedder(name)`` rebuilds it in a worker process.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

PREFIX = "synthetic:"
_NAME_KEYS = {"dim": "dim", "topics": "num_topics", "zipf": "zipf_a", "dnoise": "doc_noise"}
_NAME_KEYS |= {"qnoise": "query_noise", "seed": "seed"}  # the name's keys, in order


@dataclass(frozen=True)
class SyntheticSpec:
    dim: int = 128
    num_topics: int = 1024
    zipf_a: float = 1.1
    doc_noise: float = 0.6
    query_noise: float = 0.4
    seed: int = 0

    @property
    def name(self) -> str:
        return PREFIX + ",".join(f"{key}={getattr(self, f)}" for key, f in _NAME_KEYS.items())

    @classmethod
    def from_name(cls, name: str) -> SyntheticSpec:
        given = dict(kv.split("=") for kv in name.removeprefix(PREFIX).split(","))
        return cls(**{f: type(getattr(cls, f))(given[key]) for key, f in _NAME_KEYS.items()})

    def centers(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        c = rng.normal(size=(self.num_topics, self.dim)).astype(np.float32)
        return c / np.linalg.norm(c, axis=1, keepdims=True)


class SyntheticEmbedder:
    """``encode(texts, is_query=...)`` -> float32 ``[n, dim]`` unit vectors (see module doc)."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.dim = spec.dim
        self.name = spec.name
        self._centers = spec.centers()
        zipf = 1.0 / np.arange(1, spec.num_topics + 1) ** spec.zipf_a
        self._cdf = np.cumsum(zipf / zipf.sum())

    def encode(self, texts, *, is_query: bool = True, progress: bool = False, **_) -> np.ndarray:
        out = np.empty((len(texts), self.dim), np.float32)
        for i, text in enumerate(texts):
            head = text.split("\n", 1)[0]
            u = np.random.default_rng(zlib.crc32(head.encode())).random()
            topic = min(int(np.searchsorted(self._cdf, u)), self.spec.num_topics - 1)
            noise = np.random.default_rng(zlib.crc32(text.encode())).normal(size=self.dim)
            v = self._centers[topic] + self.spec.query_noise * noise / np.sqrt(self.dim)
            out[i] = v / np.linalg.norm(v)
        return out
