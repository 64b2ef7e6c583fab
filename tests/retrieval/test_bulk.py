"""``bench/bulk_build.py``'s bulk build of a persisted index: same format and same search
results as `VectorIndex.from_vectors(...).save(dir)`, torch k-means/assignment checked against
Faiss, and ``bench/synthetic_corpus.py``. Tiny sizes; the 200k x 768 CUDA build is `gpu`-marked."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest

from ragserve.retrieval import Document, IndexCorruptError, VectorIndex, stepwise
from ragserve.retrieval.docstore import DocStore
from ragserve.retrieval.synthetic import SyntheticEmbedder, SyntheticSpec


@pytest.fixture(scope="module")
def bulk(bench_module):
    return bench_module("bulk_build")


@pytest.fixture(scope="module")
def gpu_kmeans(bench_module):
    return bench_module("gpu_kmeans")


@pytest.fixture(scope="module")
def synthetic_corpus(bench_module):
    return bench_module("synthetic_corpus").synthetic_corpus


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _same_search(a: VectorIndex, b: VectorIndex, q: np.ndarray, nprobe: int) -> None:
    ra, rb = a.search(q, 10, nprobe), b.search(q, 10, nprobe)
    np.testing.assert_array_equal(ra.ids, rb.ids)
    np.testing.assert_array_equal(ra.scores, rb.scores)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_faiss_backend_equals_from_vectors_then_save(tmp_path, make_corpus, metric, bulk):
    docs, x = make_corpus(1500)
    ref = VectorIndex.from_vectors(docs, x, embedder_name="e", nlist=12, metric=metric)
    ref.save(tmp_path / "ref")
    result = bulk.build_index_directory(tmp_path / "bulk", docs, x, embedder_name="e", nlist=12,
                                        metric=metric)  # fmt: skip
    assert result.directory == tmp_path / "bulk"
    assert {"docstore", "train", "assign", "add", "write_index"} <= set(result.seconds)
    vi = VectorIndex.load(tmp_path / "bulk")
    vi.check_integrity()
    _same_search(vi, ref, x[:40] + 0.01, nprobe=4)
    want, got = _manifest(tmp_path / "ref"), _manifest(tmp_path / "bulk")
    for key in ("dim", "kind", "metric", "nlist", "nprobe", "embedder", "num_vectors",
                "code_size_bytes", "snapshot", "applied_seq", "generation"):  # fmt: skip
        assert got[key] == want[key], key
    assert got["applied_seq"] == len(docs) and vi.info()["pending_log_entries"] == 0
    assert sorted(os.listdir(tmp_path)) == ["bulk", "ref"]  # no scratch folder left
    vi.close()
    ref.close()


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_given_centroids_equal_faiss_index_add(tmp_path, make_corpus, metric, backend, bulk):
    """Same centroids + data: the bulk index answers exactly like one filled by `index.add`."""
    docs, x = make_corpus(2000, dim=24, seed=3)
    nlist = 16
    c = x[np.random.default_rng(1).choice(len(x), nlist, replace=False)] + 0.05
    ref = stepwise.make_ivf(24, nlist, "ivf_flat", metric)
    ref.quantizer.add(c)
    ref.is_trained = True
    ref.add_with_ids(x, np.arange(1, len(x) + 1, dtype=np.int64))
    bulk.build_index_directory(tmp_path / "b", docs, x, embedder_name="e", nlist=nlist,
                               metric=metric, centroids=c, backend=backend)  # fmt: skip
    vi = VectorIndex.load(tmp_path / "b")
    vi.check_integrity()
    bulk = vi.faiss_index
    np.testing.assert_array_equal(bulk.quantizer.reconstruct_n(0, nlist), c)
    q = x[::50] + 0.02
    for index in (ref, bulk):
        index.nprobe = 5
    d_ref, i_ref = ref.search(q, 7)
    d_bulk, i_bulk = bulk.search(q, 7)
    np.testing.assert_array_equal(i_bulk, i_ref)
    np.testing.assert_array_equal(d_bulk, d_ref)
    vi.close()


@pytest.mark.parametrize("kind", ["ivf_sq8", "ivf_pq"])
def test_other_kinds_match_from_vectors(tmp_path, make_corpus, kind, bulk):
    docs, x = make_corpus(1200, dim=16)
    kw = {"pq_nbits": 4} if kind == "ivf_pq" else {}
    ref = VectorIndex.from_vectors(docs, x, embedder_name="e", nlist=8, kind=kind, **kw)
    bulk.build_index_directory(tmp_path / "b", docs, x, embedder_name="e", nlist=8, kind=kind, **kw)
    vi = VectorIndex.load(tmp_path / "b")
    vi.check_integrity()
    _same_search(vi, ref, x[:30], nprobe=3)
    vi.close()


def test_documents_upserts_and_reload(tmp_path, make_corpus, bulk):
    docs, x = make_corpus(900)
    bulk.build_index_directory(tmp_path / "b", docs, x, embedder_name="e", nlist=8, backend="torch")
    vi = VectorIndex.load(tmp_path / "b")
    assert vi.get_documents([1, 900, 901, -1]) == [docs[0], docs[899], None, None]
    assert vi.get_documents(["d5"]) == [docs[5]]
    new = Document("new", "a new passage", "N", {"k": 1})
    vi.add_documents([new, Document("d7", "replaced")], -x[:2])
    assert vi.delete_documents(["d3", "missing"]) == 1
    vi.check_integrity()
    vi.close()
    again = VectorIndex.load(tmp_path / "b")  # replays the logged changes
    again.check_integrity()
    assert again.num_documents == 900
    assert again.get_documents([901, 902, 4, 8]) == [new, Document("d7", "replaced"), None, None]
    assert again.search(-x[:1], 1, nprobe=8).ids[0, 0] == 901
    assert again.info()["pending_log_entries"] == 4  # add 901; del 8, add 902; del 4
    again.close()


def test_corrupt_files_still_rejected(tmp_path, make_corpus, bulk):
    docs, x = make_corpus(600)
    bulk.build_index_directory(tmp_path / "b", docs, x, embedder_name="e", nlist=8)
    snap = tmp_path / "b" / _manifest(tmp_path / "b")["snapshot"]
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError) as err:
        VectorIndex.load(tmp_path / "b")
    assert err.value.path.name == snap.name
    bulk.build_index_directory(tmp_path / "c", docs, x, embedder_name="e", nlist=8)
    store = tmp_path / "c" / "docs.sqlite"
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 3])
    with pytest.raises(IndexCorruptError) as err:
        VectorIndex.load(tmp_path / "c")
    assert err.value.path.name == "docs.sqlite"


def test_bad_input_leaves_nothing(tmp_path, make_corpus, bulk):
    docs, x = make_corpus(300)
    dup = [*docs[:-1], Document("d0", "again")]
    with pytest.raises(ValueError, match="unique"):
        bulk.build_index_directory(tmp_path / "b", dup, x, embedder_name="e", nlist=4)
    with pytest.raises(ValueError, match="one vector per document"):
        bulk.build_index_directory(tmp_path / "b", docs, x[:10], embedder_name="e", nlist=4)
    assert os.listdir(tmp_path) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError):
        bulk.build_index_directory(tmp_path / "full", docs, x, embedder_name="e", nlist=4)
    stale = tmp_path / ".b.tmp-999999999"  # a dead build's scratch folder is cleaned up
    stale.mkdir()
    bulk.build_index_directory(tmp_path / "b", docs, x, embedder_name="e", nlist=4)
    assert sorted(os.listdir(tmp_path)) == ["b", "full"]


def test_write_store_needs_a_fresh_store(tmp_path, make_corpus, bulk):
    docs, x = make_corpus(50)
    assert bulk.write_store(tmp_path / "s.sqlite", docs, x) == 50
    with pytest.raises(ValueError, match="empty store"):
        bulk.write_store(tmp_path / "s.sqlite", docs, x)
    store = DocStore(tmp_path / "s.sqlite")
    assert store.last_seq() == 50 and store.ops_after(0) == []
    ids, vecs = store.vectors([2, 50])
    np.testing.assert_array_equal(ids, [2, 50])
    np.testing.assert_array_equal(vecs, x[[1, 49]])
    store.close()
    conn = sqlite3.connect(tmp_path / "s.sqlite")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    conn.close()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_torch_assign_matches_faiss_quantizer(make_corpus, gpu_kmeans, metric):
    _, x = make_corpus(3000, dim=32, seed=5)
    c = np.random.default_rng(2).normal(size=(40, 32)).astype(np.float32)
    flat = faiss.IndexFlatIP(32) if metric == "ip" else faiss.IndexFlatL2(32)
    flat.add(c)
    want = flat.assign(x, 1)[:, 0]
    got = gpu_kmeans.assign(x, c, metric, device="cpu", chunk_rows=700)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_torch_kmeans_as_good_as_faiss(gpu_kmeans, metric):
    """Same data, same iterations: our k-means objective is within a few % of Faiss's."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(64, 16)).astype(np.float32)
    x = centers[rng.integers(0, 64, 8000)] + 0.3 * rng.normal(size=(8000, 16)).astype(np.float32)
    if metric == "ip":
        x /= np.linalg.norm(x, axis=1, keepdims=True)

    def objective(c: np.ndarray) -> float:  # mean IP to the best centroid, or mean L2 to it
        flat = faiss.IndexFlatIP(16) if metric == "ip" else faiss.IndexFlatL2(16)
        flat.add(c)
        return float(flat.search(x, 1)[0].mean())

    km = faiss.Kmeans(16, 32, niter=10, seed=0, spherical=metric == "ip")
    km.train(x)
    c = gpu_kmeans.kmeans(x, 32, metric, device="cpu", niter=10, seed=0)
    np.testing.assert_array_equal(c, gpu_kmeans.kmeans(x, 32, metric, device="cpu", seed=0))
    ours, theirs, start = objective(c), objective(km.centroids), objective(x[:32].copy())
    if metric == "ip":
        np.testing.assert_allclose(np.linalg.norm(c, axis=1), 1.0, rtol=1e-5)
        assert ours >= 0.97 * theirs and ours > start + 0.1
    else:
        assert ours <= 1.1 * theirs and ours < 0.6 * start


def test_kmeans_refills_empty_clusters(gpu_kmeans):
    x = np.repeat(np.eye(4, dtype=np.float32), 25, axis=0)  # 4 distinct points, 6 clusters
    c = gpu_kmeans.kmeans(x, 6, "l2", device="cpu", niter=3)
    assert {tuple(r) for r in c.tolist()} <= {tuple(r) for r in np.eye(4).tolist()}


def test_synthetic_corpus(synthetic_corpus):
    spec = SyntheticSpec(dim=32, num_topics=16, seed=4)
    docs, x = synthetic_corpus(spec, 5000, device="cpu")
    docs2, x2 = synthetic_corpus(spec, 5000, device="cpu")
    assert x.dtype == np.float32 and x.shape == (5000, 32) and x.flags.c_contiguous
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
    assert len(docs) == 5000 and list(docs)[:3] == docs[:3] and docs[-1] == docs[4999]
    t = docs.topics
    assert docs[7] == Document("s7", f"Synthetic passage 7 about topic {t[7]}.", f"topic {t[7]}")
    assert np.bincount(t, minlength=16).min() > 5000 / 16 * 0.8  # uniform topics
    best = (x @ spec.centers().T).argmax(1)
    assert (best == t).mean() > 0.99  # each vector sits next to its topic's center
    q = SyntheticEmbedder(spec).encode(["question about x"])  # the query side is unchanged
    assert q.shape == (1, 32)
    with pytest.raises(IndexError):
        docs[5000]


@pytest.mark.gpu
def test_cuda_build_200k_x_768(tmp_path, bulk, synthetic_corpus):
    """The H200 path end to end: CUDA corpus + torch k-means/assignment, then load and check
    against Faiss: assignments differ only on float ties, searches equal a Faiss-filled index."""
    spec = SyntheticSpec(dim=768, num_topics=2048)
    docs, x = synthetic_corpus(spec, 200_000, device="cuda")
    np.testing.assert_allclose(np.linalg.norm(x[::997], axis=1), 1.0, rtol=1e-5)
    result = bulk.build_index_directory(
        tmp_path / "b", docs, x, embedder_name=spec.name, nlist=512, device="cuda"
    )
    assert set(result.seconds) >= {"train", "assign", "add", "write_index", "docstore"}
    vi = VectorIndex.load(tmp_path / "b")
    vi.check_integrity()
    assert vi.get_documents([1, 200_000]) == [docs[0], docs[199_999]]
    bulk = vi.faiss_index
    c = bulk.quantizer.reconstruct_n(0, 512)
    scores, top2 = bulk.quantizer.search(x, 2)
    labels = np.empty(len(x), np.int64)  # the list each row id landed in
    for lst in range(512):
        n = bulk.invlists.list_size(lst)
        labels[faiss.rev_swig_ptr(bulk.invlists.get_ids(lst), n) - 1] = lst
    differ = labels != top2[:, 0]
    assert differ.mean() < 1e-3
    assert np.all(np.abs(scores[differ, 0] - scores[differ, 1]) < 1e-4)  # only near-ties
    ref = stepwise.make_ivf(768, 512, "ivf_flat", "ip")
    ref.quantizer.add(c)
    ref.is_trained = True
    ref.add_with_ids(x, np.arange(1, len(x) + 1, dtype=np.int64))
    q = x[:200] + 0.01
    for index in (ref, bulk):
        index.nprobe = 16
    d_ref, i_ref = ref.search(q, 10)
    d_bulk, i_bulk = bulk.search(q, 10)
    same = (i_ref == i_bulk).all(1)
    assert same.mean() >= 0.99
    np.testing.assert_array_equal(d_bulk[same], d_ref[same])
    vi.close()
