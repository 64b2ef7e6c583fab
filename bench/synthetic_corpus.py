"""A synthetic corpus for benchmarks: ``SyntheticSpec``'s (``ragserve.retrieval.synthetic``)
documents and their unit vectors, generated with torch (on the GPU when there is one)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import numpy as np

from ragserve.retrieval.synthetic import SyntheticSpec
from ragserve.retrieval.types import Document

_CHUNK_ROWS_CPU = 1 << 14
_CHUNK_ROWS_CUDA = 1 << 18


def synthetic_corpus(
    spec: SyntheticSpec, num_docs: int, *, device: str | None = None, passage_words: int = 0
) -> tuple[SyntheticDocuments, np.ndarray]:
    """``num_docs`` documents (uniform over topics) and their unit vectors ``[num_docs, dim]``.

    The vectors are ONE float32 host array, filled chunk by chunk: center + noise drawn with
    torch on ``device`` (default: cuda when available, else cpu), normalised, copied in. The
    same spec, ``num_docs`` and device type give the same corpus (CPU and CUDA draw different
    noise); the topics, hence the documents, are the same everywhere. ``passage_words`` > 0
    grows each text by that many words (``passage_text``); the vectors do not change.
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
    return SyntheticDocuments(topics, passage_words), x


class SyntheticDocuments(Sequence):
    """The documents of ``synthetic_corpus``, made on access (millions of ``Document``
    objects would take gigabytes): ``Document(f"s{i}", passage_text(i, t, words),
    f"topic {t}")`` for row ``i`` of topic ``t``."""

    def __init__(self, topics: np.ndarray, words: int = 0) -> None:
        self.topics, self.words = topics, words

    def __len__(self) -> int:
        return len(self.topics)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, IndexError
        return _document(i, int(self.topics[i]), self.words)

    def __iter__(self) -> Iterator:
        for i, t in enumerate(self.topics.tolist()):
            yield _document(i, t, self.words)


def _document(i: int, topic: int, words: int) -> Document:
    return Document(f"s{i}", passage_text(i, topic, words), f"topic {topic}")


_WORDS = (  # noqa: SIM905 - a word list, read as prose
    "river valley harbour province census export grain railway climate coast mountain treaty "
    "council senate currency tariff forest mineral copper cotton rainfall plateau delta port "
    "dynasty republic colony language dialect festival museum archive bridge canal fortress "
    "island border capital district reform ministry industry textile fishery orchard vineyard "
    "glacier volcano desert steppe lagoon estuary meadow quarry foundry workshop library"
).split()


def passage_text(i: int, topic: int, words: int) -> str:
    """Passage ``i`` of ``topic``: the corpus's sentence, then ``words`` words of its topic's
    paragraph (the same for every passage of a topic, rotated by ``i``) -- deterministic, and
    cheap enough to write millions of."""
    head = f"Synthetic passage {i} about topic {topic}."
    if words <= 0:
        return head
    para = _paragraph(topic, words)
    cut = i % words
    return f"{head} {' '.join(para[cut:] + para[:cut])}."


@functools.cache
def _paragraph(topic: int, words: int) -> tuple[str, ...]:
    step = 1 + topic % 7
    return tuple(_WORDS[(topic * 31 + j * step) % len(_WORDS)] for j in range(words))
