"""Synthetic retrieval data for benchmarks: clustered unit vectors with skewed query popularity.

``SyntheticEmbedder`` maps text to a vector deterministically: the first line of the text
picks a topic (Zipf-skewed over ``num_topics``, seeded by its hash), the whole text adds
noise. So successive queries of one request that repeat the question (IRG's
``"{input}\\n{draft}"``) stay near each other, as HedraRAG observes of real workloads, and a
few topics take most queries (the skew a hot-cluster cache exploits). Its ``name`` encodes its
parameters, so ``load_embedder(name)`` rebuilds it in a worker process.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

PREFIX = "synthetic:"


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
        return (
            f"{PREFIX}dim={self.dim},topics={self.num_topics},zipf={self.zipf_a},"
            f"dnoise={self.doc_noise},qnoise={self.query_noise},seed={self.seed}"
        )

    @classmethod
    def from_name(cls, name: str) -> SyntheticSpec:
        fields = dict(kv.split("=") for kv in name.removeprefix(PREFIX).split(","))
        return cls(
            dim=int(fields["dim"]),
            num_topics=int(fields["topics"]),
            zipf_a=float(fields["zipf"]),
            doc_noise=float(fields["dnoise"]),
            query_noise=float(fields["qnoise"]),
            seed=int(fields["seed"]),
        )

    def centers(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        c = rng.normal(size=(self.num_topics, self.dim)).astype(np.float32)
        return c / np.linalg.norm(c, axis=1, keepdims=True)

    def topic_probs(self) -> np.ndarray:
        p = 1.0 / np.arange(1, self.num_topics + 1) ** self.zipf_a
        return p / p.sum()


class SyntheticEmbedder:
    """``encode(texts, is_query=...)`` -> float32 ``[n, dim]`` unit vectors (see module doc)."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.dim = spec.dim
        self.name = spec.name
        self._centers = spec.centers()
        self._cdf = np.cumsum(spec.topic_probs())

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


def synthetic_corpus(
    spec: SyntheticSpec, num_docs: int, *, device: str | None = None
) -> tuple[SyntheticDocuments, np.ndarray]:
    """``num_docs`` documents (uniform over topics) and their unit vectors ``[num_docs, dim]``.

    The vectors are ONE float32 host array, filled chunk by chunk: center + noise drawn with
    torch on ``device`` (default: cuda when available, else cpu), normalised, copied in. The
    same spec, ``num_docs`` and device type give the same corpus (CPU and CUDA draw different
    noise); the topics, hence the documents, are the same everywhere.
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    topics = np.random.default_rng(spec.seed + 1).integers(0, spec.num_topics, num_docs)
    x = np.empty((num_docs, spec.dim), dtype=np.float32)
    gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
    centers = torch.from_numpy(spec.centers()).to(dev)
    scale = spec.doc_noise / np.sqrt(spec.dim)
    rows = _CHUNK_ROWS_CUDA if dev.type == "cuda" else _CHUNK_ROWS_CPU
    with torch.no_grad():
        for a in range(0, num_docs, rows):
            b = min(a + rows, num_docs)
            out = torch.from_numpy(x[a:b])
            v = out if dev.type == "cpu" else torch.empty(out.shape, device=dev)
            torch.randn(v.shape, generator=gen, device=dev, out=v)
            v.mul_(scale).add_(centers[torch.from_numpy(topics[a:b]).to(dev)])
            v.div_(v.norm(dim=1, keepdim=True))
            if v is not out:
                out.copy_(v)
    return SyntheticDocuments(topics), x


_CHUNK_ROWS_CPU = 1 << 14
_CHUNK_ROWS_CUDA = 1 << 18


class SyntheticDocuments(Sequence):
    """The documents of ``synthetic_corpus``, made on access (millions of ``Document``
    objects would take gigabytes): ``Document(f"s{i}", f"Synthetic passage {i} about topic
    {t}.", f"topic {t}")`` for row ``i`` of topic ``t``."""

    def __init__(self, topics: np.ndarray) -> None:
        self.topics = topics

    def __len__(self) -> int:
        return len(self.topics)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, IndexError
        return _document(i, int(self.topics[i]))

    def __iter__(self) -> Iterator:
        from ragserve.retrieval.types import Document

        for i, t in enumerate(self.topics.tolist()):
            yield Document(f"s{i}", f"Synthetic passage {i} about topic {t}.", f"topic {t}")


def _document(i: int, topic: int):
    from ragserve.retrieval.types import Document

    return Document(f"s{i}", f"Synthetic passage {i} about topic {topic}.", f"topic {topic}")
