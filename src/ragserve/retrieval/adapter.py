"""Corpus adaptation: a linear map on the index encoder's query vectors, trained on
pseudo-queries drawn from the corpus itself (no evaluation question is ever seen).

```
pairs    (pseudo-query, passage): the passage's own section heading, or its first sentence
train    W (dim x dim, starts at I) minimising, over batches B of pairs,
           CE( normalise(W q_i) . p_j / temperature over j in B, target i )  +  reg * |W - I|^2
         p: the passage vectors the index already stores (nothing is re-embedded);
         other pairs of the same passage in a batch are masked, not negatives
search   q' = normalise(W q)   (queries only; stored vectors unchanged)
```

The matrix is saved beside the index (`query_adapter.npy`) with its sha256 in the index
metadata, so a damaged file is an error on load, never a silently different ranking.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ragserve.retrieval.embedder import Embedder
    from ragserve.retrieval.types import Document

CONFIG_KEY = "query_adapter"  # index metadata: {"config": AdaptConfig, "sha256": ..., ...}
FILE = "query_adapter.npy"
SOURCES = ("heading", "sentence")
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")
_WORD = re.compile(r"[A-Za-z]{2,}")


@dataclass(frozen=True)
class AdaptConfig:
    """What the query map is trained on and how. Defaults: the best plateau on the pydocs tune
    half (BENCHMARKS.md, "Retrieval quality (issue 14)", fifth run)."""

    sources: tuple[str, ...] = ("sentence",)
    held_out: bool = True  # targets: the passage re-embedded without the query (else stored)
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    temperature: float = 0.05
    reg: float = 0.1  # weight of |W - I|^2 (per element, summed)
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if not self.sources or bad:
            raise ValueError(f"adapter sources must be among {', '.join(SOURCES)}, got {bad}")
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError("adapter epochs must be >= 1 and batch_size >= 2")
        if self.lr <= 0 or self.temperature <= 0 or self.reg < 0:
            raise ValueError("adapter lr and temperature must be > 0, reg >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sources": list(self.sources)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdaptConfig:
        return cls(**{**data, "sources": tuple(data["sources"])})


class PseudoPair(NamedTuple):
    """A pseudo-query, the passage it comes from (index into the docs) and the text to embed as
    its target when the query is held out of it (None: the passage's stored vector)."""

    query: str
    doc: int
    held_out_text: str | None


def pseudo_pairs(
    docs: Sequence[Document], sources: Sequence[str], header: str = "path"
) -> list[PseudoPair]:
    """Pairs drawn from the passages alone, deterministic, in `docs` order: `heading`, the last
    heading of the passage's section (or its title) when it has >= 2 words, held out as the
    passage's text without its heading path; `sentence`, the passage's first sentence when it
    has 4-40 words and more follows, held out as the passage (with `header`) without it."""
    from ragserve.retrieval.index import passage_text

    pairs: list[PseudoPair] = []
    for i, doc in enumerate(docs):
        if "heading" in sources:
            section = str(doc.metadata.get("section") or doc.title or "")
            heading = section.split(" > ")[-1].strip()
            if len(_WORD.findall(heading)) >= 2:
                pairs.append(PseudoPair(heading, i, doc.text))
        if "sentence" in sources:
            parts = _SENTENCE_END.split(doc.text.strip(), maxsplit=1)
            if len(parts) == 2 and 4 <= len(parts[0].split()) <= 40:
                rest = dataclasses.replace(doc, text=parts[1])
                pairs.append(PseudoPair(parts[0], i, passage_text(rest, header)))
    return pairs


def in_batch_loss(logits, owners):
    """Cross-entropy of each row's own column (``logits[i, i]``) against the batch's others;
    columns of the same owner as the row (another pair of its passage) are masked out, not
    negatives. ``logits`` ``[b, b]``, ``owners`` ``[b]`` (torch tensors)."""
    import torch

    same = owners[:, None] == owners[None, :]
    logits = logits.masked_fill(same & ~torch.eye(len(owners), dtype=torch.bool), -1e9)
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(owners)))


def train_query_map(
    queries: np.ndarray,
    passages: np.ndarray,
    targets: np.ndarray,
    config: AdaptConfig,
    owners: np.ndarray | None = None,
) -> np.ndarray:
    """The `[dim, dim]` float32 map W for `queries[i]` -> `passages[targets[i]]` (unit rows),
    by Adam on the in-batch contrastive loss above; pairs of the same owner (default: the same
    target) are not each other's negatives. Deterministic for a given input and seed."""
    import torch

    q = np.asarray(queries, dtype=np.float32)
    p = np.asarray(passages, dtype=np.float32)
    targets = np.asarray(targets, dtype=np.int64)
    if q.ndim != 2 or p.ndim != 2 or q.shape[1] != p.shape[1] or len(targets) != len(q):
        raise ValueError(f"need [n, d] queries, [m, d] passages, n targets: {q.shape}, {p.shape}")
    if len(q) and (targets.min() < 0 or targets.max() >= len(p)):
        raise ValueError("adapter targets must index the passages")
    owners = targets if owners is None else np.asarray(owners, dtype=np.int64)
    dim = q.shape[1]
    generator = torch.Generator().manual_seed(config.seed)
    w = torch.eye(dim, requires_grad=True)
    eye = torch.eye(dim)
    opt = torch.optim.Adam([w], lr=config.lr)
    qt, pt, tt = torch.from_numpy(q), torch.from_numpy(p), torch.from_numpy(targets)
    ot = torch.from_numpy(owners)
    for _ in range(config.epochs):
        order = torch.randperm(len(q), generator=generator)
        for start in range(0, len(q), config.batch_size):
            batch = order[start : start + config.batch_size]
            if len(batch) < 2:
                continue
            mapped = torch.nn.functional.normalize(qt[batch] @ w.T, dim=1)
            loss = in_batch_loss(mapped @ pt[tt[batch]].T / config.temperature, ot[batch])
            loss = loss + config.reg * ((w - eye) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w.detach().numpy().astype(np.float32)


class QueryAdapter:
    """A trained query map; `apply` maps `[n, dim]` query vectors to unit vectors. Immutable."""

    def __init__(self, matrix: np.ndarray) -> None:
        m = np.ascontiguousarray(matrix, dtype=np.float32)
        if m.ndim != 2 or m.shape[0] != m.shape[1] or not np.isfinite(m).all():
            raise ValueError(f"query adapter must be a finite square matrix, got {m.shape}")
        m.setflags(write=False)
        self.matrix = m

    @property
    def dim(self) -> int:
        return self.matrix.shape[0]

    def apply(self, vectors: np.ndarray) -> np.ndarray:
        x = np.asarray(vectors, dtype=np.float32) @ self.matrix.T
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        return (x / np.maximum(norms, 1e-12)).astype(np.float32)

    def sha256(self) -> str:
        return hashlib.sha256(self.matrix.tobytes()).hexdigest()

    def save(self, path: Path) -> None:
        np.save(path, self.matrix)

    @classmethod
    def load(cls, path: Path, sha256: str | None = None) -> QueryAdapter:
        """Read `path`; raises `ValueError` (one line, naming the file) if it is missing,
        unreadable, not a square matrix or does not match `sha256`."""
        try:
            adapter = cls(np.load(path, allow_pickle=False))
        except (OSError, ValueError, EOFError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"unreadable query adapter {path}: {reason}") from None
        if sha256 is not None and adapter.sha256() != sha256:
            raise ValueError(f"unreadable query adapter {path}: checksum mismatch")
        return adapter


def fit_adapter(
    docs: Sequence[Document],
    passages: np.ndarray,
    embedder: Embedder,
    config: AdaptConfig,
    header: str = "path",
) -> tuple[QueryAdapter, int]:
    """Pseudo-pairs of `docs` embedded with `embedder` (queries as queries; held-out targets as
    passages, else `passages`: `docs`' stored vectors, same order), the map trained on them.
    Returns the adapter and the pair count."""
    pairs = pseudo_pairs(docs, config.sources, header)
    if not pairs:
        raise ValueError("no pseudo-queries in the corpus (no headings or sentences to use)")
    q = embedder.encode([p.query for p in pairs], is_query=True)
    if config.held_out:
        targets = embedder.encode([p.held_out_text for p in pairs], is_query=False)
        index = np.arange(len(pairs))
        owner = np.array([p.doc for p in pairs])
        matrix = train_query_map(q, targets, index, config, owner)
    else:
        matrix = train_query_map(q, passages, np.array([p.doc for p in pairs]), config)
    return QueryAdapter(matrix), len(pairs)


class AdaptedEmbedder:
    """An embedder whose query vectors go through a `QueryAdapter`; passages, tokenizer,
    window and every other attribute are the wrapped embedder's."""

    def __init__(self, inner: Embedder, adapter: QueryAdapter) -> None:
        if adapter.dim != inner.dim:
            raise ValueError(f"query adapter is {adapter.dim}-d, embedder {inner.dim}-d")
        self.inner = inner
        self.adapter = adapter

    def encode(self, texts: Sequence[str], *, is_query: bool, **kwargs: Any) -> np.ndarray:
        vectors = self.inner.encode(texts, is_query=is_query, **kwargs)
        return self.adapter.apply(vectors) if is_query and len(vectors) else vectors

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def adapt_queries(index: Any, embedder: Any) -> Any:
    """`embedder` with `index`'s query adapter applied to its queries (itself when the index
    has none), for code that embeds queries for an index with its own embedder instance."""
    adapter = getattr(index, "query_adapter", None)
    if adapter is None or isinstance(embedder, AdaptedEmbedder):
        return embedder
    return AdaptedEmbedder(embedder, adapter)


# -- in the index (VectorIndex) and beside its snapshot (called by persist.py) ---------------------


class QueryAdapterMixin:
    """`VectorIndex`'s side of corpus adaptation: `enable_query_adapter` trains the map on the
    live passages once; from then on `embedder` maps queries through it. Later upserts do not
    retrain it."""

    _query_adapter: QueryAdapter | None

    @property
    def query_adapter(self) -> QueryAdapter | None:
        return self._query_adapter

    def enable_query_adapter(
        self, config: AdaptConfig | None = None, *, embedder: Embedder | None = None
    ) -> int:
        """Train a query map (`config`, default `AdaptConfig()`) on pseudo-pairs of the live
        passages, embedded with `embedder` (default: the index's own, unadapted) and record it.
        Returns the number of pairs. Persisted at the next save/compaction."""
        config = config or AdaptConfig()
        with self._write_mutex:
            row_ids, stored = self.vectors_of(self._store.row_ids_where("1"))
            docs = self._store.get(row_ids.tolist())
            encoder = embedder or self._base_embedder()
            adapter, num_pairs = fit_adapter(docs, stored, encoder, config, self.passage_header)
            if adapter.dim != self.dim:
                raise ValueError(f"query adapter is {adapter.dim}-d, the index {self.dim}-d")
            self._query_adapter = adapter
            self.metadata[CONFIG_KEY] = {
                "config": config.to_dict(),
                "sha256": adapter.sha256(),
                "num_pairs": num_pairs,
                "num_passages": len(docs),
            }
        return num_pairs


def save_file(vi: Any, directory: Path) -> None:
    """Write the index's adapter matrix into `directory` (atomically) unless it is there."""
    adapter = vi.query_adapter
    path = directory / FILE
    if adapter is None or path.is_file():
        return
    import io

    from ragserve.retrieval.storage import atomic_write_bytes

    buffer = io.BytesIO()
    np.save(buffer, adapter.matrix)
    atomic_write_bytes(path, buffer.getvalue())


def load_file(directory: Path, metadata: dict[str, Any]) -> QueryAdapter | None:
    """The recorded adapter (its checksum verified), or None when the index has none."""
    recorded = metadata.get(CONFIG_KEY)
    if not recorded:
        return None
    return QueryAdapter.load(directory / FILE, recorded.get("sha256"))
