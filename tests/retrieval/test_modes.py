"""Search modes: metadata filters (only matching documents, and `topk` of them when enough
match), BM25 kept in sync with the dense index, reciprocal rank fusion, nprobe defaults."""

from __future__ import annotations

import operator
import zlib

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex, modes
from ragserve.retrieval.bm25 import BM25Index, passage_text
from ragserve.retrieval.calibrate import calibrate_nprobe
from ragserve.retrieval.filters import validate_filter

WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "olive", "peach", "plum",
         "quince", "raisin", "sugar", "tomato", "vanilla", "walnut", "yam", "zucchini")  # fmt: skip


OPS = {"gte": operator.ge, "gt": operator.gt, "lte": operator.le, "lt": operator.lt}


def matches(metadata: dict, flt: dict | None) -> bool:
    """The oracle of `filters.filter_sql`: whether a passage's metadata passes `flt`."""
    for key, cond in (flt or {}).items():
        if key not in metadata or metadata[key] is None:
            return False
        value = metadata[key]
        values = value if isinstance(value, list) else [value]
        if not any(_passes(v, cond) for v in values):
            return False
    return True


def _passes(value, cond) -> bool:
    """Text compares with text only, numbers with numbers."""
    if isinstance(cond, dict):
        same_kind = all(isinstance(value, str) == isinstance(b, str) for b in cond.values())
        try:
            return same_kind and all(OPS[op](value, b) for op, b in cond.items())
        except TypeError:
            return False
    options = cond if isinstance(cond, list) else [cond]
    return any(value == c and isinstance(value, str) == isinstance(c, str) for c in options)


class BagOfWordsEmbedder:
    """Deterministic stand-in for a text encoder: hashed bag of words, unit norm."""

    name = "bag-of-words"
    dim = 32

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, zlib.crc32(word.strip(".:,").encode()) % self.dim] += 1.0
            out[i] /= max(np.linalg.norm(out[i]), 1e-6)
        return out


def corpus(n: int, seed: int = 0, prefix: str = "d") -> list[Document]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, 6))
        tags = ["odd" if i % 2 else "even"]
        meta = {"source": f"s{i % 5}.md", "year": 2000 + i % 12, "tags": tags}
        docs.append(Document(f"{prefix}{i}", text, f"Title {i % 7}", meta))
    return docs


@pytest.fixture
def index():
    emb = BagOfWordsEmbedder()
    docs = corpus(400)
    vi = VectorIndex.from_vectors(
        docs, emb.encode([passage_text(d) for d in docs], is_query=False),
        embedder_name=emb.name, nlist=8, nprobe=2, embedder=emb,
    )  # fmt: skip
    yield vi
    vi.close()


FILTERS = [
    {"source": "s1.md"},
    {"source": ["s1.md", "s3.md"]},
    {"year": {"gte": 2003, "lte": 2006}},
    {"year": {"gt": 2003, "lt": 2006}, "tags": "odd"},
    {"source": "s2.md", "tags": ["even"], "year": {"gte": 2010}},
    {"source": "nowhere.md"},
]


def _oracle(vi: VectorIndex, q: np.ndarray, topk: int, flt) -> np.ndarray:
    """Best `topk` scores per query among the matching documents (brute force over all)."""
    row_ids, x = vi.vectors_of(vi.allowed_row_ids({}))
    docs = vi.get_documents(row_ids)
    keep = np.array([matches(d.metadata, flt) for d in docs], dtype=bool)
    return -np.sort(-(q @ x[keep].T), axis=1)[:, :topk]


@pytest.mark.parametrize("flt", FILTERS)
@pytest.mark.parametrize("exhaustive", [True, False])
def test_filtered_search_equals_the_subset_oracle(index, flt, exhaustive, monkeypatch):
    nprobe = None
    if not exhaustive:  # Faiss id selector, every cluster probed: exact as well
        monkeypatch.setattr(modes, "EXHAUSTIVE_FILTER_MAX", 0)
        nprobe = index.nlist
    q = index.embedder.encode(["apple mango", "plum walnut yam", "zucchini"], is_query=True)
    topk = 10
    found = index.search(q, topk, nprobe, filter=flt)
    want = _oracle(index, q, topk, flt)
    for ids, scores, expected in zip(found.ids, found.scores, want, strict=True):
        got = [int(i) for i in ids if i >= 0]
        assert len(got) == len(expected)  # topk whenever enough documents match
        np.testing.assert_allclose(scores[: len(got)], expected, rtol=1e-5, atol=1e-6)
        for doc in index.get_documents(got):
            assert matches(doc.metadata, flt)


@pytest.mark.parametrize("flt", FILTERS)
def test_narrow_probes_widen_until_topk_match(index, flt, monkeypatch):
    monkeypatch.setattr(modes, "EXHAUSTIVE_FILTER_MAX", 0)
    q = index.embedder.encode(["apple", "yam", "plum olive"], is_query=True)
    num_matching = len(index.allowed_row_ids(flt))
    found = index.search(q, 25, 1, filter=flt)
    for ids in found.ids:
        got = [int(i) for i in ids if i >= 0]
        assert len(got) == min(25, num_matching)
        assert all(matches(d.metadata, flt) for d in index.get_documents(got))


def test_sql_filter_equals_the_python_predicate(index):
    row_ids = index.allowed_row_ids({})
    docs = index.get_documents(row_ids)
    for flt in FILTERS:
        want = [int(r) for r, d in zip(row_ids, docs, strict=True) if matches(d.metadata, flt)]
        assert list(index.allowed_row_ids(flt)) == want


def test_filter_type_rules():
    assert matches({"year": 2005}, {"year": {"gte": 2000}})
    assert not matches({"year": 2005}, {"year": {"gte": "2000"}})  # text bound, number value
    assert not matches({"year": "2005"}, {"year": 2005})
    assert matches({"tags": ["a", "b"]}, {"tags": "b"})
    assert not matches({}, {"tags": "b"})


@pytest.mark.parametrize(
    "bad, field",
    [
        ([1], "object"),
        ({"": 1}, "key"),
        ({"k": {"near": 1}}, "k"),
        ({"k": []}, "k"),
        ({"k": {"gte": 1, "lte": "z"}}, "k"),
        ({"k": {"a": 1}}, "k"),
        ({"k": None}, "k"),
    ],
)
def test_bad_filters_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        validate_filter(bad)


def test_rrf_matches_a_hand_computed_fusion():
    dense = np.array([10, 20, 30, -1])
    lexical = np.array([30, 40, 10])
    fused = modes.rrf_fuse([dense, lexical], topk=4, k=60)
    expected = {
        10: 1 / 61 + 1 / 63,
        20: 1 / 62,
        30: 1 / 63 + 1 / 61,
        40: 1 / 62,
    }
    assert [i for i, _ in fused] == [10, 30, 20, 40]  # ties: first seen first
    for doc_id, score in fused:
        assert score == pytest.approx(expected[doc_id], abs=1e-12)


def test_hybrid_is_the_fusion_of_dense_and_bm25(index):
    queries = ["apple mango", "walnut yam sugar"]
    depth = modes.HYBRID_DEPTH
    dense = index.search(index.embedder.encode(queries, is_query=True), depth)
    lexical = index.bm25().search(queries, depth)
    hybrid = index.search_text(queries, 5, mode="hybrid")
    for q in range(len(queries)):
        want = modes.rrf_fuse([dense.ids[q], lexical.ids[q]], 5)
        assert [h.id for h in hybrid[q]] == [
            d.id for d in index.get_documents([i for i, _ in want])
        ]
        assert [h.score for h in hybrid[q]] == pytest.approx([s for _, s in want])


def test_dense_mode_is_the_plain_faiss_search(index):
    q = ["apple mango", "plum"]
    want = index.documents_of(index.search(index.embedder.encode(q, is_query=True), 7))
    got = index.search_text(q, 7, mode="dense")
    assert [[h.id for h in hits] for hits in got] == [[h.id for h in hits] for hits in want]
    assert index.search_text(q, 7) == got  # default mode of an index without one: dense


def test_bm25_mode_and_filters(index):
    hits = index.search_text(["quince quince"], 50, mode="bm25", filter={"source": "s4.md"})[0]
    assert hits and all("quince" in h.text for h in hits)
    assert all(h.document.metadata["source"] == "s4.md" for h in hits)
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError, match="mode"):
        index.search_text(["x"], 3, mode="sparse")


def _fresh_bm25_ranking(vi: VectorIndex, queries: list[str], k: int):
    rows = vi.allowed_row_ids({})
    docs = vi.get_documents(rows)
    fresh = BM25Index.from_texts(rows, [passage_text(d) for d in docs])
    return fresh.search(queries, k)


def _assert_bm25_in_sync(vi: VectorIndex) -> None:
    vi.check_integrity()  # Faiss ids == store rows == BM25 rows
    queries = ["apple banana", "zucchini yam walnut", "updated"]
    got, want = vi.bm25().search(queries, 20), _fresh_bm25_ranking(vi, queries, 20)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)


def test_bm25_follows_upserts_deletes_saves_and_loads(index, tmp_path):
    emb = index.embedder
    index.bm25()
    index.save(tmp_path / "idx")
    new = [Document(f"d{i}", "updated text zucchini", "New", {"source": "n.md"}) for i in range(5)]
    index.add_documents(new, emb.encode([passage_text(d) for d in new], is_query=False))
    index.delete_documents(["d10", "d11", "missing"])
    _assert_bm25_in_sync(index)
    reloaded = VectorIndex.load(tmp_path / "idx", embedder=emb)  # snapshot + log replay
    _assert_bm25_in_sync(reloaded)
    reloaded.close()
    index.compact()
    assert sorted(p.name for p in (tmp_path / "idx").glob("bm25-*")) == ["bm25-000002"]
    index.delete_documents(["d12"])
    again = VectorIndex.load(tmp_path / "idx", embedder=emb)
    _assert_bm25_in_sync(again)
    assert again.get_documents(["d12"]) == [None]
    again.close()


def test_corrupt_bm25_snapshot_is_named(index, tmp_path):
    from ragserve.retrieval import IndexCorruptError

    index.bm25()
    index.save(tmp_path / "idx")
    (tmp_path / "idx" / "bm25-000001" / "row_ids.npy").write_bytes(b"garbage")
    with pytest.raises(IndexCorruptError, match="bm25-000001"):
        VectorIndex.load(tmp_path / "idx")


def test_small_indexes_are_exhaustive_by_default():
    emb = BagOfWordsEmbedder()
    docs = corpus(300)
    vi = VectorIndex.from_vectors(
        docs, emb.encode([d.text for d in docs], is_query=False), embedder_name=emb.name, nlist=8
    )
    assert vi.spec.nprobe == 8
    assert vi.info()["nprobe_calibration"] == {"nprobe": 8, "rule": "exhaustive"}


def test_calibrated_nprobe_reaches_the_recall_target(make_corpus, monkeypatch):
    from ragserve.retrieval import calibrate

    monkeypatch.setattr(calibrate, "EXHAUSTIVE_MAX_VECTORS", 100)
    docs, x = make_corpus(3000, dim=16, seed=3)
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=64)
    cal = vi.metadata["nprobe_calibration"]
    assert cal["rule"] == "recall" and cal["nprobe"] == vi.spec.nprobe == vi.info()["nprobe"]
    assert cal["recall"] >= 0.95 and cal["num_queries"] == 256
    assert 1 < vi.spec.nprobe < 64  # clustered data: neither one cluster nor all of them
    higher = calibrate_nprobe(vi.faiss_index, x, target=min(1.0, cal["recall"] + 1e-3))
    assert higher.nprobe > vi.spec.nprobe  # a higher target needs more probes
    assert calibrate_nprobe(vi.faiss_index, x, target=1.1).nprobe == 64
