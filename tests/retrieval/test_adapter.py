"""Corpus adaptation (`adapter.py`): pseudo-pairs, the trained query map, its switch, its file."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.adapter import (
    AdaptConfig,
    AdaptedEmbedder,
    QueryAdapter,
    pseudo_pairs,
    train_query_map,
)
from ragserve.retrieval.index import passage_text
from ragserve.retrieval.storage import IndexCorruptError

WORDS = tuple(f"w{i}" for i in range(200))
QUERIES = ["w1 w7 w9", "w12 w40", "w3 w3 w150", "w199 w0 w100 w5"]
FAST = AdaptConfig(epochs=3, batch_size=16)


class HashedWords:
    """Deterministic stand-in for a text encoder: hashed bag of words, unit norm."""

    name, dim = "hashed", 24

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                h = zlib.crc32(word.strip(".:,?").encode())
                out[i, h % self.dim] += 1.0 + (h >> 8) % 997 / 997
            out[i] /= max(np.linalg.norm(out[i]), 1e-6)
        return out


def corpus(n: int = 60, seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        first = " ".join(rng.choice(WORDS, 6)) + "."
        rest = " ".join(rng.choice(WORDS, 10)) + ". " + " ".join(rng.choice(WORDS, 8)) + "."
        section = f"Guide > Part {i % 5} > Topic about w{i} w{i + 1}"
        docs.append(Document(f"d{i}", f"{first} {rest}", section, {"section": section}))
    return docs


def build(docs=None, adapt: AdaptConfig | None = None) -> tuple[VectorIndex, HashedWords]:
    encoder = HashedWords()
    vi = VectorIndex.build(docs or corpus(), encoder, nlist=4, nprobe=4)
    if adapt is not None:
        vi.enable_query_adapter(adapt)
    return vi, encoder


def test_pseudo_pairs_come_from_the_passages_and_hold_the_query_out():
    docs = corpus(10)
    pairs = pseudo_pairs(docs, ("heading", "sentence"))
    assert pairs == pseudo_pairs(docs, ("heading", "sentence"))  # deterministic
    assert [p.doc for p in pairs] == sorted(p.doc for p in pairs)
    headings = [p for p in pairs if p.query.startswith("Topic")]
    sentences = [p for p in pairs if not p.query.startswith("Topic")]
    assert len(headings) == len(sentences) == 10
    for p in headings:
        assert p.held_out_text == docs[p.doc].text  # the heading path left out
    for p in sentences:
        assert docs[p.doc].text.startswith(p.query)
        assert p.query not in p.held_out_text and p.held_out_text.startswith(docs[p.doc].title)
    assert pseudo_pairs(docs, ("heading",)) == headings
    with pytest.raises(ValueError, match="adapter sources"):
        AdaptConfig(sources=("questions",))


def test_training_is_deterministic_and_learns_a_rotation():
    """Queries are a fixed rotation of their passages (plus noise): the unadapted top-1 is
    poor, the trained map recovers most of it."""
    rng = np.random.default_rng(1)
    dim, n = 16, 256
    p = rng.normal(size=(n, dim))
    p = (p / np.linalg.norm(p, axis=1, keepdims=True)).astype(np.float32)
    rotation, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    q = (p @ rotation.T + 0.05 * rng.normal(size=(n, dim))).astype(np.float32)
    config = AdaptConfig(epochs=10, batch_size=64, lr=0.05, reg=0.0, temperature=0.1)
    w = train_query_map(q, p, np.arange(n), config)
    np.testing.assert_array_equal(w, train_query_map(q, p, np.arange(n), config))

    def top1(queries):
        return float(((queries @ p.T).argmax(axis=1) == np.arange(n)).mean())

    assert top1(q) < 0.3
    assert top1(QueryAdapter(w).apply(q)) > 0.9


def test_identity_map_and_switch_off_change_nothing():
    docs = corpus()
    plain, encoder = build(docs)
    assert plain.query_adapter is None and plain.embedder is encoder
    expected = plain.search(encoder.encode(QUERIES, is_query=True), 5)
    got = plain.search_text(QUERIES, 5, mode="dense", collapse_sections=False)
    assert [[h.id for h in hits] for hits in got] == [
        [d.id for d in row] for row in plain.documents_of(expected)
    ]
    same = QueryAdapter(np.eye(encoder.dim, dtype=np.float32))
    np.testing.assert_allclose(
        AdaptedEmbedder(encoder, same).encode(QUERIES, is_query=True),
        encoder.encode(QUERIES, is_query=True),
        atol=1e-6,
    )


def test_adapted_search_equals_the_mapped_query_oracle():
    vi, encoder = build(adapt=FAST)
    adapter = vi.query_adapter
    assert adapter is not None and not np.allclose(adapter.matrix, np.eye(encoder.dim))
    assert vi.metadata["query_adapter"]["num_pairs"] == 60
    mapped = adapter.apply(encoder.encode(QUERIES, is_query=True))
    oracle = vi.documents_of(vi.search(mapped, 5))
    got = vi.search_text(QUERIES, 5, mode="dense", collapse_sections=False)
    assert [[h.id for h in r] for r in got] == [[d.id for d in r] for r in oracle]
    # passages are never mapped: an upsert stores the plain passage vector
    new = Document("new", "w1 w2 w3.", "New", {})
    vi.add_documents([new])
    rows, x = vi.vectors_of(vi.indexed_ids())
    ids = [d.id for d in vi.get_documents(rows.tolist())]
    np.testing.assert_array_equal(
        x[ids.index("new")], encoder.encode([passage_text(new)], is_query=False)[0]
    )


def test_two_builds_train_the_same_map():
    a, _ = build(adapt=FAST)
    b, _ = build(adapt=FAST)
    np.testing.assert_array_equal(a.query_adapter.matrix, b.query_adapter.matrix)


def test_adapter_survives_save_and_load_and_a_corrupt_file_is_one_line_error(tmp_path):
    vi, encoder = build(adapt=FAST)
    vi.save(tmp_path / "idx")
    expected = vi.search_text(QUERIES, 5, mode="dense")
    vi.close()
    loaded = VectorIndex.load(tmp_path / "idx", embedder=encoder)
    np.testing.assert_array_equal(loaded.query_adapter.matrix, vi.query_adapter.matrix)
    got = loaded.search_text(QUERIES, 5, mode="dense")
    assert [[h.id for h in r] for r in got] == [[h.id for h in r] for r in expected]
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["metadata"]["query_adapter"]["sha256"] == loaded.query_adapter.sha256()
    loaded.close()

    path = tmp_path / "idx" / "query_adapter.npy"
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF  # one value changed: still a valid .npy, the checksum catches it
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexCorruptError, match="checksum mismatch") as info:
        VectorIndex.load(tmp_path / "idx", embedder=encoder)
    assert "\n" not in str(info.value) and "query_adapter.npy" in str(info.value)
    path.write_bytes(bytes(raw[:50]))  # truncated
    with pytest.raises(IndexCorruptError, match="query_adapter.npy") as info:
        VectorIndex.load(tmp_path / "idx", embedder=encoder)
    assert "\n" not in str(info.value)
    path.unlink()
    with pytest.raises(IndexCorruptError, match="query_adapter.npy"):
        VectorIndex.load(tmp_path / "idx", embedder=encoder)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="square matrix"):
        QueryAdapter(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="finite"):
        QueryAdapter(np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match="queries"):
        train_query_map(np.zeros((3, 4)), np.zeros((3, 5)), np.arange(3), FAST)
    with pytest.raises(ValueError, match="no pseudo-queries"):
        build([Document(f"d{i}", f"w{i}", "", {}) for i in range(6)], FAST)
