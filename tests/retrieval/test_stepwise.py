"""Step-wise search equals Faiss's one-shot `index.search` for every kind, metric and split."""

from __future__ import annotations

import itertools
import os
import signal
import threading

import faiss
import numpy as np
import pytest

from ragserve.retrieval import stepwise
from ragserve.retrieval.types import ProbePlan, TopK

DIM, NUM, NLIST, K = 16, 4000, 32, 10


def _clustered(rng: np.random.Generator, n: int, centers: np.ndarray) -> np.ndarray:
    pick = rng.integers(0, len(centers), n)
    return (centers[pick] + 0.4 * rng.normal(size=(n, centers.shape[1]))).astype(np.float32)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(NLIST, DIM)).astype(np.float32)
    x = _clustered(rng, NUM, centers)
    x[100:106] = x[7]  # exact duplicates: ties inside the top-k
    q = np.concatenate([x[7:8] + 1e-3, _clustered(rng, 47, centers)])
    return x, q


@pytest.fixture(scope="module")
def indexes(data) -> dict[tuple[str, str], faiss.IndexIVF]:
    x, _ = data
    out = {}
    for kind, metric in itertools.product(stepwise.KINDS, ("ip", "l2")):
        index = stepwise.make_ivf(DIM, NLIST, kind, metric, pq_m=4)
        stepwise.train(index, x)
        index.add_with_ids(x, np.arange(NUM, dtype=np.int64) * 5 + 3)
        out[kind, metric] = index
    return out


def _faiss(index: faiss.IndexIVF, q: np.ndarray, k: int, nprobe: int):
    index.nprobe = nprobe
    return index.search(q, k)


@pytest.mark.parametrize("kind", stepwise.KINDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("nprobe", [1, 5, 12])
def test_any_split_any_order_equals_faiss(indexes, data, kind, metric, nprobe):
    index, (_, q) = indexes[kind, metric], data
    ref_d, ref_i = _faiss(index, q, K, nprobe)
    plan = stepwise.assign(index, q, nprobe)
    is_l2 = metric == "l2"
    rng = np.random.default_rng(nprobe)
    splits = [1, 2, 4, nprobe]
    for num_steps in splits:
        steps = plan.split(num_steps)
        for order in (range(len(steps)), rng.permutation(len(steps))):
            state = None
            for s in order:
                state = stepwise.merge(state, stepwise.scan(index, q, steps[s], K), is_l2)
            np.testing.assert_array_equal(state.ids, ref_i)
            np.testing.assert_array_equal(state.scores, ref_d)
    # per-query random reordering and uneven steps (rows padded with -1 via `take`)
    ranks = np.stack([rng.permutation(nprobe) for _ in range(len(q))])
    cut = int(rng.integers(0, nprobe + 1))
    first = plan.take(np.where(np.arange(nprobe) < cut, ranks, -1))
    second = plan.take(np.where(np.arange(nprobe) >= cut, ranks, -1))
    state = stepwise.merge(
        stepwise.scan(index, q, second, K), stepwise.scan(index, q, first, K), is_l2
    )
    np.testing.assert_array_equal(state.ids, ref_i)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_ties_keep_faiss_order(indexes, data, metric):
    index, (_, q) = indexes["ivf_flat", metric], data
    ref_d, ref_i = _faiss(index, q[:1], K, NLIST)
    dup_ids = np.array([7, 100, 101, 102, 103, 104, 105]) * 5 + 3
    assert set(dup_ids) <= set(ref_i[0])  # the duplicates tie inside the top-k
    assert len(set(ref_d[0][np.isin(ref_i[0], dup_ids)])) == 1
    got = stepwise.search(index, q[:1], K, NLIST, num_steps=NLIST)
    np.testing.assert_array_equal(got.ids, ref_i)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_full_probe_ivf_flat_equals_brute_force(indexes, data, metric):
    x, q = data
    brute = faiss.IndexFlatIP(DIM) if metric == "ip" else faiss.IndexFlatL2(DIM)
    brute.add(x)
    ref_d, ref_i = brute.search(q, K)
    got = stepwise.search(indexes["ivf_flat", metric], q, K, NLIST, num_steps=3)
    np.testing.assert_allclose(got.scores, ref_d, rtol=1e-4, atol=1e-4)
    # compare as sets of row positions where scores are not tied with a neighbour
    same = (got.ids - 3) // 5 == ref_i
    tied = np.isclose(ref_d[:, :, None], ref_d[:, None, :], rtol=1e-5).sum(-1) > 1
    assert (same | tied).all()


@pytest.mark.parametrize("kind", stepwise.KINDS)
def test_recall_never_drops_as_nprobe_grows(indexes, data, kind):
    x, q = data
    brute = faiss.IndexFlatL2(DIM)
    brute.add(x)
    _, truth = brute.search(q, K)
    truth = truth * 5 + 3
    recalls = []
    for nprobe in (1, 2, 4, 8, 16, 32):
        got = stepwise.search(indexes[kind, "l2"], q, K, nprobe, num_steps=2)
        hits = [len(set(g) & set(t)) for g, t in zip(got.ids, truth, strict=True)]
        recalls.append(np.mean(hits) / K)
    assert all(b >= a for a, b in zip(recalls, recalls[1:], strict=False)), recalls
    assert recalls[-1] > recalls[0]


def test_missing_results_are_minus_one(indexes, data):
    index, (_, q) = indexes["ivf_flat", "l2"], data
    k = NUM  # more than one list holds
    got = stepwise.search(index, q[:2], k, 1, num_steps=1)
    ref_d, ref_i = _faiss(index, q[:2], k, 1)
    np.testing.assert_array_equal(got.ids, ref_i)
    assert (got.ids == -1).any()
    assert np.isinf(got.scores[got.ids == -1]).all()


def test_empty_step_and_bad_shapes(indexes, data):
    index, (_, q) = indexes["ivf_flat", "ip"], data
    empty = ProbePlan(np.zeros((len(q), 0), np.int64), np.zeros((len(q), 0), np.float32))
    assert (stepwise.scan(index, q, empty, K).ids == -1).all()
    with pytest.raises(ValueError, match="shape"):
        stepwise.assign(index, q[:, :3], 4)
    with pytest.raises(ValueError, match="unknown index kind"):
        stepwise.make_ivf(DIM, 4, "hnsw")


@pytest.mark.parametrize("is_l2", [True, False])
def test_merge_orders_cross_step_ties_like_faiss(is_l2):
    rng = np.random.default_rng(1)
    n, k = 200, 8

    def canonical(ids, scores):  # reference order: score, then Faiss's id order
        key = scores if is_l2 else -scores
        order = np.lexsort((ids if is_l2 else -ids, key), axis=-1)
        return np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)

    # integer-valued scores: many exact ties inside and across the two inputs
    ids = rng.permutation(2 * n * k).reshape(n, 2 * k).astype(np.int64)
    scores = rng.integers(0, 6, size=(n, 2 * k)).astype(np.float32)
    a = TopK(*canonical(ids[:, :k], scores[:, :k]))
    b = TopK(*canonical(ids[:, k:], scores[:, k:]))
    ref_ids, ref_scores = canonical(ids, scores)
    got = stepwise.merge(a, b, is_l2)
    np.testing.assert_array_equal(got.ids, ref_ids[:, :k])
    np.testing.assert_array_equal(got.scores, ref_scores[:, :k])
    np.testing.assert_array_equal(stepwise.merge(b, a, is_l2).ids, got.ids)  # symmetric


@pytest.fixture
def scan_calls(monkeypatch):
    """The (start, stop) row ranges of every Faiss `search_preassigned` call `scan` makes."""
    calls = []
    real = stepwise._scan_rows

    def record(*args):
        calls.append(args[-2:])
        real(*args)

    monkeypatch.setattr(stepwise, "_scan_rows", record)
    monkeypatch.setattr(stepwise, "MIN_SCAN_ROWS_PER_THREAD", 0)  # these indexes are tiny
    previous = stepwise.set_scan_threads(None)
    yield calls
    stepwise.set_scan_threads(previous)


@pytest.mark.parametrize("kind", stepwise.KINDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_parallel_scan_is_bit_identical_to_one_thread_and_faiss(
    indexes, data, kind, metric, scan_calls
):
    index, (_, q) = indexes[kind, metric], data
    for n in (1, 3, len(q)):  # n = 1, n < threads, n > threads
        ref_d, ref_i = _faiss(index, q[:n], K, 5)
        plan = stepwise.assign(index, q[:n], 5)
        got = {}
        for threads in (1, 4):
            stepwise.set_scan_threads(threads)
            scan_calls.clear()
            got[threads] = stepwise.scan(index, q[:n], plan, K)
            ranges = sorted(scan_calls)
            assert len(ranges) == min(n, threads)  # the switch decides how the batch is cut
            assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])]
            assert ranges[-1][1] == n
            np.testing.assert_array_equal(got[threads].ids, ref_i)
            np.testing.assert_array_equal(got[threads].scores, ref_d)
        assert got[1].scores.tobytes() == got[4].scores.tobytes()


def test_concurrent_parallel_scans_match_the_one_thread_scan(indexes, data, scan_calls):
    from concurrent.futures import ThreadPoolExecutor

    index, (_, q) = indexes["ivf_pq", "l2"], data
    plan = stepwise.assign(index, q, 7)
    stepwise.set_scan_threads(1)
    ref = stepwise.scan(index, q, plan, K)
    stepwise.set_scan_threads(3)
    with ThreadPoolExecutor(4) as callers:  # several Python threads share the scan pool
        outs = list(callers.map(lambda _: stepwise.scan(index, q, plan, K), range(8)))
    for out in outs:
        np.testing.assert_array_equal(out.ids, ref.ids)
        np.testing.assert_array_equal(out.scores, ref.scores)
    assert any(t.name.startswith(stepwise._POOL_PREFIX) for t in threading.enumerate())


def test_a_failing_range_raises_after_every_range_is_done(indexes, data, monkeypatch):
    import time

    index, (_, q) = indexes["ivf_flat", "ip"], data
    done = []

    def rows(*args):
        if args[-2] == 0:
            raise RuntimeError("range 0 failed")
        time.sleep(0.2)  # the others still read the index when range 0 fails
        done.append(args[-2])

    monkeypatch.setattr(stepwise, "_scan_rows", rows)
    monkeypatch.setattr(stepwise, "MIN_SCAN_ROWS_PER_THREAD", 0)
    previous = stepwise.set_scan_threads(3)
    try:
        with pytest.raises(RuntimeError, match="range 0 failed"):
            stepwise.scan(index, q, stepwise.assign(index, q, 5), K)
    finally:
        stepwise.set_scan_threads(previous)
    assert sorted(done) == [16, 32]  # NOTE: both finished before the error reached the caller


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_scans_on_its_own_pool(indexes, data, scan_calls):
    index, (_, q) = indexes["ivf_flat", "l2"], data
    plan = stepwise.assign(index, q, 5)
    stepwise.set_scan_threads(3)
    ref = stepwise.scan(index, q, plan, K)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # NOTE: the child reports through its exit code only
        signal.alarm(20)  # a pool inherited without its threads would hang here
        got = stepwise.scan(index, q, plan, K)
        same = np.array_equal(got.ids, ref.ids) and np.array_equal(got.scores, ref.scores)
        os._exit(0 if same and len(scan_calls) == 6 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_index_in_faiss_parallel_mode_is_scanned_in_one_call(indexes, data, scan_calls):
    index, (_, q) = indexes["ivf_sq8", "ip"], data
    ref_d, ref_i = _faiss(index, q, K, 5)
    stepwise.set_scan_threads(4)
    index.parallel_mode = 3  # Faiss parallelises the call itself: no second split on top
    try:
        got = stepwise.scan(index, q, stepwise.assign(index, q, 5), K)
    finally:
        index.parallel_mode = 0
    assert scan_calls == [(0, len(q))]
    np.testing.assert_array_equal(got.ids, ref_i)
    np.testing.assert_array_equal(got.scores, ref_d)


def test_small_scans_are_not_split(indexes, data, scan_calls, monkeypatch):
    index, (_, q) = indexes["ivf_flat", "ip"], data
    plan = stepwise.assign(index, q, 5)
    ref = stepwise.scan(index, q, plan, K)
    stepwise.set_scan_threads(4)
    est = len(q) * 5 * index.ntotal / index.nlist  # probed rows at the mean list size
    for per_thread, expected in ((est + 1, 1), (est / 2, 2), (est / 3, 3), (1, 4)):
        monkeypatch.setattr(stepwise, "MIN_SCAN_ROWS_PER_THREAD", int(per_thread))
        scan_calls.clear()
        got = stepwise.scan(index, q, plan, K)
        assert len(scan_calls) == expected
        np.testing.assert_array_equal(got.ids, ref.ids)
        np.testing.assert_array_equal(got.scores, ref.scores)


def test_scan_threads_setting_and_bad_values(monkeypatch, scan_calls):
    assert stepwise.scan_threads() == max(1, faiss.omp_get_max_threads())
    stepwise.set_scan_threads(5)
    assert stepwise.scan_threads() == 5
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match="scan threads must be a positive integer"):
            stepwise.set_scan_threads(bad)
    monkeypatch.setenv(stepwise.SCAN_THREADS_ENV, "3")
    assert stepwise._threads_from_env() == 3
    monkeypatch.setenv(stepwise.SCAN_THREADS_ENV, "two")
    with pytest.raises(ValueError, match="RAGSERVE_CPU_SCAN_THREADS must be a positive"):
        stepwise._threads_from_env()
