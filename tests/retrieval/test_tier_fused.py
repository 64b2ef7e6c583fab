"""The GPU tier's fused scan (``tier_scan.fused_scan``, a Triton kernel over the chunk pool)
equals grouped, dense and Faiss's one-shot search.

CPU: the kernel under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: it must be
set before triton is imported; skipped where triton is not installed). GPU (``gpu``): compiled.
Cases: IP and L2; float32 through ``index.search`` (ids exactly, scores to 1e-5) at partial
and full coverage, nprobe 1 to all lists, queries with no resident probe, duplicate vectors
(ties), k larger than a list and than a chunk, dim 24 and 64; float16 and bfloat16 pools
against a float64 oracle over the same rounded vectors; the block choice of the kernel.
"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.tier_scan import FMA_MAX_QUERIES, fused_block_m, plan_grouped

HERE = Path(__file__).parent
NUM, NLIST, K, NPROBE = 1500, 24, 10, 6
BIG = 1 << 30


def make_index(metric: str, dim: int) -> tuple[VectorIndex, np.ndarray]:
    """Clustered vectors with duplicates (seven equal rows: ties across the k-th boundary) and
    queries on and near them."""
    rng = np.random.default_rng(dim + 1)  # NOTE: seed 64 has an L2 near-tie below float32
    centers = rng.normal(size=(NLIST, dim)).astype(np.float32)
    x = (centers[rng.integers(0, NLIST, NUM)] + 0.4 * rng.normal(size=(NUM, dim))).astype(
        np.float32
    )
    x[100:106] = x[7]
    docs = [Document(f"d{i}", f"passage {i}") for i in range(NUM)]
    index = VectorIndex.from_vectors(
        docs, x, embedder_name="none", nlist=NLIST, metric=metric, nprobe=NPROBE
    )
    near = centers[rng.integers(0, NLIST, 21)] + 0.4 * rng.normal(size=(21, dim))
    q = np.concatenate([x[7:8], x[7:8] + 1e-3, near]).astype(np.float32)
    return index, q


def oracle(index: VectorIndex, q: np.ndarray, k: int = K, nprobe: int = NPROBE):
    return index.faiss_index.search(q, k, params=faiss.SearchParametersIVF(nprobe=nprobe))


def stored_vectors(index: VectorIndex) -> dict[int, np.ndarray]:
    """Each id's vector as the Faiss index holds it (its ids are the store's, not row numbers)."""
    ivf = faiss.extract_index_ivf(index.faiss_index)
    out = {}
    for lst in range(ivf.nlist):
        n = ivf.invlists.list_size(lst)
        if n == 0:
            continue
        ids = faiss.rev_swig_ptr(ivf.invlists.get_ids(lst), n)
        codes = faiss.rev_swig_ptr(ivf.invlists.get_codes(lst), n * ivf.code_size)
        rows = codes.view(np.float32).reshape(n, ivf.d).astype(np.float64)
        out.update(zip(ids.tolist(), rows, strict=True))
    return out


def assert_same(found, ref, l2: tuple[VectorIndex, np.ndarray] | None = None) -> None:
    """Ids exactly, scores of real hits to 1e-5 relative (pads: Faiss writes -+FLT_MAX,
    ragserve inf), and an absolute part scaled by the largest score.

    ``l2`` (an L2 index and its queries): the tier computes a distance as
    ``|x|^2 - 2 q.x + |q|^2`` and Faiss directly, so float32 cancellation leaves an error of a
    few ulps of the terms ``|q|^2 + |x|^2`` (2 ulps at ~56 on CUDA: 7.6e-6 against Faiss's 0),
    and two hits closer than that may trade places. Each such place must hold a hit whose
    exact (float64) distance is within that tolerance of Faiss's at that rank and is not an
    exact duplicate of Faiss's hit there (which of equal vectors comes first still counts)."""
    hit = ref[1] >= 0
    np.testing.assert_array_equal(found.ids >= 0, hit)
    scale = max(1.0, float(np.abs(ref[0][hit]).max(initial=0.0)))
    if l2 is None:
        np.testing.assert_array_equal(found.ids, ref[1])
        np.testing.assert_allclose(found.scores[hit], ref[0][hit], rtol=1e-5, atol=1e-6 * scale)
        return
    vec, q = stored_vectors(l2[0]), l2[1].astype(np.float64)
    terms = (q * q).sum(1) + max(float(v @ v) for v in vec.values())
    atol = np.broadcast_to((8 * np.finfo(np.float32).eps * terms)[:, None], hit.shape)
    err = np.abs(found.scores - ref[0])[hit]
    assert np.all(err <= atol[hit] + 1e-5 * np.abs(ref[0][hit])), err.max()
    for r, p in np.argwhere(found.ids != ref[1]):
        mine, theirs = (((vec[int(i)] - q[r]) ** 2).sum() for i in (found.ids[r, p], ref[1][r, p]))
        assert mine != theirs, (r, p, "equal vectors in another order than Faiss's")
        assert abs(mine - ref[0][r, p]) <= atol[r, p], (r, p, mine, ref[0][r, p])
    for row in found.ids:
        assert len(set(row[row >= 0].tolist())) == int((row >= 0).sum())


def check_float32(metric: str, dim: int, device: str) -> None:
    """fused == grouped == dense == Faiss through ``index.search`` (module doc)."""
    index, q = make_index(metric, dim)
    data = (index, q) if metric == "l2" else None
    sizes = index.cluster_sizes()
    partial = np.random.default_rng(1).choice(NLIST, 9, replace=False)
    for clusters in (partial, range(NLIST)):
        tier = index.set_gpu_tier(BIG, device=device, clusters=clusters, scan="fused")
        for nprobe in (1, NPROBE, NLIST):
            ref = oracle(index, q, K, nprobe)
            for scan in ("fused", "grouped", "dense") if nprobe == NPROBE else ("fused",):
                tier.set_scan(scan)
                assert_same(index.search(q, K, nprobe), ref, data)
        tier.set_scan("fused")
        for k in (1, 3):  # fewer than the seven equal vectors: which of them is kept counts
            assert_same(index.search(q, k, NPROBE), oracle(index, q, k, NPROBE), data)
        big_k = int(sizes.max()) + 40  # more than a list and than the probed rows
        assert_same(index.search(q, big_k, 2), oracle(index, q, big_k, 2), data)
        assert_same(index.search(q, 300, NLIST), oracle(index, q, 300, NLIST), data)  # > a chunk
        counts = tier.scan_counts
        assert counts["fused"] >= 6 and counts["grouped"] == counts["dense"] == 1, counts
        tier.check_integrity()
    lone = index.assign(q, 1).cluster_ids
    assert not np.isin(lone, partial).all()  # some queries had no resident probe at nprobe 1
    index.close()


def check_half(metric: str, dtype: str, device: str) -> None:
    """A float16/bfloat16 pool: the fused keys equal a float64 oracle over the same rounded
    vectors and float32 biases (ids exactly), grouped's to its own half-precision rounding."""
    import torch

    from ragserve.retrieval.tier_scan import canonical_topk, fused_scan, grouped_scan

    index, q = make_index(metric, 24)
    tier = index.set_gpu_tier(BIG, device=device, clusters=range(NLIST), dtype=dtype, scan="fused")
    lc = index.assign(q, NPROBE).cluster_ids
    plan = plan_grouped(lc, tier._counts_ext)
    pool = tier._pool
    qd = torch.from_numpy(q).to(device).to(pool.vectors.dtype)
    lcd = torch.from_numpy(lc).to(device)
    keys, ids = fused_scan(torch, pool, qd, lcd, plan, K)
    a = 2.0 if metric == "l2" else 1.0
    vec = pool.vectors.double().cpu()
    want = torch.full((len(q), NPROBE * 256), -np.inf, dtype=torch.float64)
    want_ids = torch.full((len(q), NPROBE * 256), -1, dtype=torch.int64)
    chunk_list = pool.chunk_list.cpu()
    for i, lists in enumerate(lc):
        rows = torch.from_numpy(np.isin(chunk_list.numpy(), lists)).nonzero().ravel()
        s = a * (vec[rows] @ qd[i].double().cpu()) + pool.bias[rows].double().cpu()
        want[i, : s.numel()] = s.reshape(-1)
        want_ids[i, : s.numel()] = pool.ids[rows].cpu().reshape(-1)
    top_keys, top_ids = canonical_topk(torch, want, want_ids, K, metric == "l2")
    np.testing.assert_array_equal(ids.cpu().numpy(), top_ids.numpy())
    np.testing.assert_allclose(keys.cpu().double().numpy(), top_keys.numpy(), rtol=1e-5, atol=1e-5)
    g_keys, _ = grouped_scan(torch, pool, qd, lcd, plan, K)
    np.testing.assert_allclose(g_keys.cpu().numpy(), keys.cpu().numpy(), rtol=2e-2, atol=2e-2)
    index.close()


def _position_independent_dot() -> None:
    # NOTE: the interpreter's tl.dot is NumPy's BLAS matmul, whose edge tiles round differently
    # from inner ones, so equal vectors at different rows of a block get keys 1 ulp apart and
    # exact ties break. Compiled, an ieee fp32 tl.dot accumulates each element in the same
    # order wherever it sits; so does this sum over k.
    import triton.runtime.interpreter as interp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        prod = a.data.astype(acc)[:, :, None] * b.data.astype(acc)[None, :, :]
        return interp.TensorHandle(prod.sum(axis=1) + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot


def check_swaps(metric: str, device: str, rounds: int) -> None:
    """Searches while lists are loaded, evicted and their chunks reused: never a stale row."""
    import test_gpu_tier as g

    from ragserve.retrieval.partition import PlacementConfig

    index, q = g.make_index(metric)
    config = PlacementConfig(update_every=1, max_swap_bytes=4096)
    index.access_counts.observe(np.repeat(index.assign(q, g.NPROBE).cluster_ids, 50, 0))
    tier = index.set_gpu_tier(g.tier_bytes(index, 12), device=device, placement=config,
                              scan="fused")  # fmt: skip
    g.search_during_churn(index, q, g.oracle(index, q), rounds=rounds)
    assert tier.scan_counts["fused"] > 0
    tier.wait_idle()
    tier.check_integrity()
    index.close()


def check_slices(device: str) -> None:
    """A batch cut into slices of one query (``MAX_FUSED_SCORES`` lowered), some of them with
    no resident probe, equals Faiss."""
    from ragserve.retrieval import tier_scan

    index, q = make_index("ip", 24)
    partial = np.random.default_rng(1).choice(NLIST, 9, replace=False)
    tier = index.set_gpu_tier(BIG, device=device, clusters=partial, scan="fused")
    before = tier_scan.MAX_FUSED_SCORES
    tier_scan.MAX_FUSED_SCORES = 1
    try:
        for nprobe in (1, NPROBE):
            assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
    finally:
        tier_scan.MAX_FUSED_SCORES = before
    assert tier.scan_counts["fused"] == 2
    index.close()


def interpreter_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (the sweep; the default tier runs
    ``check_slices`` alone)."""
    _position_independent_dot()
    check_float32("ip", 24, "cpu")  # NOTE: each metric at one dim: the interpreter is slow
    check_float32("l2", 64, "cpu")
    for metric in ("ip", "l2"):
        check_half(metric, "float16", "cpu")
    check_swaps("l2", "cpu", rounds=6)


def test_interpreter_matches_faiss_in_slices() -> None:
    """The small exactness case: the kernel under the interpreter equals Faiss at partial
    coverage, one query per launch, with and without resident probes."""
    pytest.importorskip("triton")
    from testing import run_in_triton_interpreter

    code = "import test_tier_fused as t; t._position_independent_dot(); t.check_slices('cpu')"
    run_in_triton_interpreter(HERE, code)


@pytest.mark.slow  # the interpreter runs each program in Python: ~13 s for the sweep
def test_interpreter_matches_faiss() -> None:
    pytest.importorskip("triton")
    from testing import run_in_triton_interpreter

    run_in_triton_interpreter(HERE, "import test_tier_fused as t; t.interpreter_checks()")


def test_block_choice() -> None:
    """FMA blocks at the run's own size up to ``FMA_MAX_QUERIES``, tl.dot blocks of 16-64."""
    assert [fused_block_m(m)[:2] for m in (1, 2, 3, 4)] == [(1, False), (2, False), (4, False),
                                                             (4, False)]  # fmt: skip
    assert FMA_MAX_QUERIES == 4
    assert [fused_block_m(m)[:2] for m in (5, 16, 17, 64, 1000)] == [
        (16, True), (16, True), (32, True), (64, True), (64, True)
    ]  # fmt: skip


def test_cost_model_fits_fused_where_timed() -> None:
    """With fused timings the model fits it and picks it where it is predicted fastest;
    fitted without them it never picks (or predicts) fused."""
    from ragserve.retrieval.tier_scan import ScanCostModel, ScanFeatures, ScanSample

    truth = {"dense": (2e-5, 3e-10, 1e-11), "grouped": (3e-4, 1e-9, 1e-10),
             "fused": (1e-4, 1e-10, 2e-11)}  # fmt: skip
    rng = np.random.default_rng(2)
    samples = []
    for _ in range(12):
        f = ScanFeatures(*(int(v) for v in rng.integers([1, 1e4, 1e3, 1e3], [256, 1e7, 1e6, 1e8])))
        samples.append(ScanSample(f, {s: float(np.dot(c, f.terms(s))) for s, c in truth.items()}))
    model = ScanCostModel.fit(samples)
    np.testing.assert_allclose(model.fused, truth["fused"], rtol=1e-6)
    assert model.strategies == ("grouped", "dense", "fused")
    for sample in samples:
        best = min(truth, key=lambda s: sample.seconds[s])
        assert model.choose(sample.features) == best
    without = ScanCostModel.fit(
        [ScanSample(s.features, {k: v for k, v in s.seconds.items() if k != "fused"})
         for s in samples]
    )  # fmt: skip
    assert without.fused is None and without.strategies == ("grouped", "dense")
    assert all(without.choose(s.features) != "fused" for s in samples)
    with pytest.raises(ValueError, match="strategy"):
        without.predict("fused", samples[0].features)


def test_fused_on_cpu_without_interpreter_is_refused() -> None:
    pytest.importorskip("triton")
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("the interpreter is on in this process")
    index, _ = make_index("ip", 24)
    with pytest.raises(ValueError, match="fused"):
        index.set_gpu_tier(BIG, device="cpu", clusters=[0], scan="fused")
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=[0], scan="grouped")
    with pytest.raises(ValueError, match="fused"):
        tier.set_scan("fused")
    assert "fused" not in tier.strategies  # auto never considers it on CPU
    index.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [24, 64])  # NOTE: dim 768: the device bench checks its ids
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_cuda_fused_matches_faiss(metric: str, dim: int) -> None:
    check_float32(metric, dim, "cuda")


@pytest.mark.gpu
def test_cuda_fused_during_swaps_and_in_slices() -> None:
    check_swaps("ip", "cuda", rounds=20)
    check_slices("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_cuda_fused_half(metric: str, dtype: str) -> None:
    check_half(metric, dtype, "cuda")
