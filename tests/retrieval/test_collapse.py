"""Section collapsing: at most one passage per section, each section's best passage in rank
order (oracle: the full uncollapsed ranking, filtered by hand), `topk` sections whenever that
many exist, the switch per query and per index, and the uncollapsed path still plain Faiss."""

from __future__ import annotations

import numpy as np
import pytest
from test_modes import BagOfWordsEmbedder

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.bm25 import passage_text
from ragserve.retrieval.collapse import FETCH_FACTOR, collapse_hits, section_key
from ragserve.retrieval.types import ScoredDocument

WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "olive", "peach", "plum")


def sectioned_corpus() -> list[Document]:
    """12 sections in 3 files; section 0 has 60 passages about "apple" (more than
    topk * FETCH_FACTOR), the others 1-6 passages of random words."""
    rng = np.random.default_rng(1)
    docs = []
    for s in range(12):
        count = 60 if s == 0 else 1 + s % 6
        for c in range(count):
            words = ["apple"] * 3 if s == 0 else list(rng.choice(WORDS, 5))
            meta = {"source": f"f{s % 3}.rst", "section": f"Guide > Part {s}", "chunk": c}
            docs.append(Document(f"f{s % 3}.rst#{s}.{c}", " ".join(words), f"Part {s}", meta))
    return docs


@pytest.fixture
def index():
    emb = BagOfWordsEmbedder()
    docs = sectioned_corpus()
    vi = VectorIndex.from_vectors(
        docs, emb.encode([passage_text(d) for d in docs], is_query=False),
        embedder_name=emb.name, nlist=4, nprobe=4, embedder=emb,
    )  # fmt: skip
    yield vi
    vi.close()


def _sections(hits) -> list:
    return [section_key(h.document) for h in hits]


def test_section_key_per_kind_of_passage():
    ingested = Document("a.md#3", "t", "A > B", {"source": "a.md", "section": "A > B"})
    record = Document("r7#1", "t", None, {"source_id": "r7", "chunk": 1})
    factbook = Document("fr/government", "t", "France", {"section": "Government"})
    assert section_key(ingested) == ("section", "a.md", "A > B")
    assert section_key(record) == ("record", "r7")
    assert section_key(factbook) == ("passage", "fr/government")  # section alone: no group


def test_collapse_hits_keeps_each_sections_first_hit_in_order():
    def hit(doc_id, source, section, score):
        meta = {"source": source, "section": section}
        return ScoredDocument(Document(doc_id, "t", section, meta), score)

    rows = [("a#3", "a", "A", 0.9), ("a#4", "a", "A", 0.8), ("b#0", "b", "B", 0.7),
            ("a#5", "a", "A", 0.6), ("c#1", "c", "C", 0.5), ("x#0", "x", "A", 0.4)]  # fmt: skip
    hits = [hit(*row) for row in rows]
    assert [h.id for h in collapse_hits(hits, 10)] == ["a#3", "b#0", "c#1", "x#0"]
    assert [h.id for h in collapse_hits(hits, 2)] == ["a#3", "b#0"]
    assert [h.score for h in collapse_hits(hits, 3)] == [0.9, 0.7, 0.5]
    assert collapse_hits([], 3) == []
    with pytest.raises(ValueError, match="topk"):
        collapse_hits(hits, 0)


def _deepening_oracle(vi: VectorIndex, query: str, topk: int, mode: str):
    """Collapse of the uncollapsed ranking, fetched `FETCH_FACTOR` times deeper until it holds
    `topk` sections (hybrid fuses the two rankings to the depth asked, so its order depends on
    it)."""
    depth = topk
    while True:
        hits = vi.search_text([query], depth, mode=mode, collapse_sections=False)[0]
        found = collapse_hits(hits, topk)
        if len(found) == topk or len(hits) < depth or depth >= vi.num_documents:
            return found
        depth = min(vi.num_documents, depth * FETCH_FACTOR)


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_collapsed_search_equals_the_collapsed_ranking(index, mode):
    queries = ["apple", "apple plum", "lemon grape olive"]
    full = index.search_text(queries, index.num_documents, mode=mode, collapse_sections=False)
    got = index.search_text(queries, 5, mode=mode, collapse_sections=True)
    for q, query in enumerate(queries):
        oracles = [_deepening_oracle(index, query, 5, mode)]
        if mode != "hybrid":  # a dense or BM25 ranking does not depend on its depth
            oracles.append(collapse_hits(full[q], 5))
        for want in oracles:  # equal scores may swap passages of one section
            assert _sections(got[q]) == _sections(want), mode
            assert [h.score for h in got[q]] == pytest.approx([h.score for h in want]), mode
        assert len(set(_sections(got[q]))) == len(got[q])
    if mode == "dense":  # 60 "apple" passages rank first: found by fetching deeper
        assert 5 * FETCH_FACTOR < 60 and len(got[0]) == 5
        assert full[0][5].document.metadata["section"] == "Guide > Part 0"


def test_uncollapsed_dense_search_is_plain_faiss(index):
    q = ["apple mango", "plum"]
    want = index.documents_of(index.search(index.embedder.encode(q, is_query=True), 7))
    got = index.search_text(q, 7, mode="dense", collapse_sections=False)
    assert [[h.id for h in hits] for hits in got] == [[h.id for h in hits] for hits in want]
    assert len(set(_sections(got[0]))) < 7  # the "apple" section fills the plain top 7


def test_index_default_and_filter(index):
    q = ["apple"]
    collapsed = index.search_text(q, 5, collapse_sections=True)
    assert index.collapse_sections and index.search_text(q, 5) == collapsed  # default: on
    index.metadata["collapse_sections"] = False  # as `ragserve index build --no-collapse-...`
    assert not index.collapse_sections
    assert index.search_text(q, 5) == index.search_text(q, 5, collapse_sections=False)
    assert index.info()["collapse_sections"] is False
    flt = {"source": "f0.rst"}
    hits = index.search_text(q, 5, filter=flt, collapse_sections=True)[0]
    assert [h.document.metadata["source"] for h in hits] == ["f0.rst"] * 4  # 4 sections in f0
    assert len(set(_sections(hits))) == 4


def test_fewer_sections_than_topk_returns_them_all(index):
    hits = index.search_text(["apple"], 50, collapse_sections=True)[0]
    assert len(hits) == 12 and len(set(_sections(hits))) == 12
