"""VectorIndex: search equals Faiss, documents, upsert semantics, save/load, compaction,
concurrent searches during upserts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex


def _build(docs, x, **kw) -> VectorIndex:
    return VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8, **kw)


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_sq8", "ivf_pq"])
def test_search_equals_faiss_one_shot(small_corpus, kind):
    docs, x = small_corpus
    vi = _build(docs, x, kind=kind, pq_m=4, pq_nbits=4)
    q = x[:20] + 0.01
    got = vi.search(q, 7, nprobe=3)
    vi.faiss_index.nprobe = 3
    ref_d, ref_i = vi.faiss_index.search(q, 7)
    np.testing.assert_array_equal(got.ids, ref_i)
    np.testing.assert_array_equal(got.scores, ref_d)
    # step-wise through the public API, last step first
    plan = vi.assign(q, 3)
    state = vi.scan(q, plan.columns(2, 3), 7)
    state = vi.scan(q, plan.columns(0, 2), 7, state)
    np.testing.assert_array_equal(state.ids, ref_i)


def test_scan_with_bare_cluster_ids_is_exact_for_flat(small_corpus):
    docs, x = small_corpus
    vi = _build(docs, x)
    q = x[:10]
    plan = vi.assign(q, 4)
    a = vi.scan(q, plan.cluster_ids, 5)
    b = vi.scan(q, plan, 5)
    np.testing.assert_array_equal(a.ids, b.ids)


def test_documents_upsert_and_delete(small_corpus):
    docs, x = small_corpus
    vi = _build(docs, x)
    top = vi.search(x[:1], 1, nprobe=8)
    assert vi.get_documents([int(top.ids[0, 0]), -1]) == [docs[0], None]
    assert vi.get_documents(["d5", "nope"]) == [docs[5], None]
    # replace d0's text and vector: same doc id, new row id, old row gone
    new = Document("d0", "replaced", None, {})
    vi.add_documents([new], x[1:2])
    assert vi.get_documents(["d0"]) == [new]
    assert vi.get_documents([int(top.ids[0, 0])]) == [None]
    assert vi.num_documents == len(docs)
    assert vi.delete_documents(["d0", "d1", "missing"]) == 2
    assert vi.num_documents == len(docs) - 2
    hits = vi.documents_of(vi.search(x[:2], 5, nprobe=8))
    assert all(h.id not in ("d0", "d1") for row in hits for h in row)
    with pytest.raises(ValueError, match="shape"):
        vi.add_documents([Document("z", "z")], np.zeros((1, 3), np.float32))


def test_save_load_round_trip_with_log_replay_and_compaction(tmp_path, small_corpus, make_corpus):
    docs, x = small_corpus
    vi = _build(docs, x, metric="l2")
    vi.metadata = {"note": "kept"}
    vi.save(tmp_path / "idx")
    extra, xe = make_corpus(30, seed=3, prefix="e")
    vi.add_documents(extra, xe)
    vi.delete_documents([f"d{i}" for i in range(10)])
    q = np.concatenate([x[:5], xe[:5]])
    before = vi.search(q, 10, nprobe=4)

    loaded = VectorIndex.load(tmp_path / "idx")  # snapshot + replay of the 40 logged ops
    assert loaded.info()["pending_log_entries"] == 40
    after = loaded.search(q, 10, nprobe=4)
    np.testing.assert_array_equal(after.ids, before.ids)
    assert loaded.metadata == {"note": "kept"} and loaded.spec == vi.spec
    assert loaded.get_documents(["e3", "d3"]) == [extra[3], None]

    vi.compact()
    assert sorted(p.name for p in (tmp_path / "idx").glob("index-*")) == ["index-000002.faiss"]
    again = VectorIndex.load(tmp_path / "idx")
    assert again.info()["pending_log_entries"] == 0 and again.generation == 2
    np.testing.assert_array_equal(again.search(q, 10, nprobe=4).ids, before.ids)
    for index in (vi, loaded, again):
        index.close()


def test_save_refuses_non_empty_directory(tmp_path, small_corpus):
    docs, x = small_corpus
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        _build(docs, x).save(tmp_path / "busy")


def test_automatic_compaction(tmp_path, small_corpus):
    docs, x = small_corpus
    vi = _build(docs, x)
    vi.save(tmp_path / "idx")
    vi.compact_every = 5
    for i in range(12):
        vi.add_documents([Document(f"n{i}", "new")], x[i : i + 1])
    assert vi.generation == 3 and vi.info()["pending_log_entries"] == 2
    assert VectorIndex.load(tmp_path / "idx").num_documents == len(docs) + 12


def test_concurrent_searches_during_upserts(small_corpus):
    docs, x = small_corpus
    vi = _build(docs[:300], x[:300])
    errors: list[BaseException] = []
    stop = threading.Event()

    def searcher() -> None:
        try:
            while not stop.is_set():
                r = vi.search(x[:16], 5, nprobe=8)
                assert (r.ids >= 0).all()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    for start in range(300, 600, 30):
        vi.add_documents(docs[start : start + 30], x[start : start + 30])
        vi.delete_documents([f"d{start - 300}"])
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert vi.num_documents == 600 - 10
    final = vi.search(x[:16], 5, nprobe=8)
    vi.faiss_index.nprobe = 8
    np.testing.assert_array_equal(final.ids, vi.faiss_index.search(x[:16], 5)[1])


def test_one_writer_per_folder(tmp_path, small_corpus):
    docs, x = small_corpus
    vi = _build(docs, x)
    vi.save(tmp_path / "idx")
    other = VectorIndex.load(tmp_path / "idx")
    vi.add_documents([Document("a", "a")], x[:1])  # vi becomes the writer
    assert other.search(x[:2], 3).ids.shape == (2, 3)  # readers are fine
    with pytest.raises(RuntimeError, match="another process"):
        other.delete_documents(["d1"])
    vi.close()  # releases the folder
    other.delete_documents(["d1"])
    other.close()


def test_pq_needs_enough_training_vectors(make_corpus):
    docs, x = make_corpus(100)
    with pytest.raises(ValueError, match="pq_nbits"):
        _build(docs, x, kind="ivf_pq", pq_m=4)
