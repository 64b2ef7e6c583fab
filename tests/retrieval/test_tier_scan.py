"""The GPU tier's scan strategies (run on CPU tensors): grouped, dense and auto each equal Faiss's
one-shot search at partial and full coverage, for IP and L2, in any split of the probes, during
swaps and after upserts and deletes; the cost model fits, and auto picks by it."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_tier import (
    BIG,
    NLIST,
    NPROBE,
    K,
    assert_same,
    make_index,
    oracle,
    search_during_churn,
    tier_bytes,
)

from ragserve.retrieval import Document
from ragserve.retrieval.partition import PlacementConfig
from ragserve.retrieval.tier_scan import ScanCostModel, ScanFeatures, ScanSample, plan_grouped

SCANS = ("grouped", "dense", "auto")


@pytest.fixture(scope="module", params=["ip", "l2"])
def built(request):
    index, q = make_index(request.param)
    yield index, q
    index.drop_gpu_tier()


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("coverage", ["partial", "full"])
def test_every_strategy_equals_faiss(built, scan: str, coverage: str) -> None:
    index, q = built
    rng = np.random.default_rng(1)
    clusters = rng.choice(NLIST, 13, replace=False) if coverage == "partial" else range(NLIST)
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=clusters, scan=scan)
    assert tier.scan_strategy == scan
    for nprobe in (1, NPROBE, NLIST):
        assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
    assert_same(index.search(q[:1], 3), oracle(index, q[:1], 3))
    assert_same(index.search(q, 1, NPROBE), oracle(index, q, 1, NPROBE))
    counts = tier.scan_counts
    if scan != "auto":
        assert counts[scan] > 0 and sum(counts.values()) == counts[scan]
    else:
        assert tier.cost_model is not None and sum(counts.values()) > 0
    tier.check_integrity()


@pytest.mark.parametrize("scan", ["grouped", "dense"])
def test_any_split_and_order_equals_faiss(built, scan: str) -> None:
    index, q = built
    rng = np.random.default_rng(5)
    index.set_gpu_tier(BIG, device="cpu", clusters=rng.choice(NLIST, 16, replace=False), scan=scan)
    plan = index.assign(q, NPROBE)
    ranks = np.argsort(rng.random(plan.cluster_ids.shape), axis=1)  # per-query order
    state = None
    for a in range(0, NPROBE, 3):
        state = index.scan(q, plan.take(ranks[:, a : a + 3]), K, state)
    assert_same(state, oracle(index, q))


def test_strategies_agree_in_half_precision(built) -> None:
    index, q = built
    tier = index.set_gpu_tier(
        BIG, device="cpu", clusters=range(NLIST), dtype="float16", scan="grouped"
    )
    found = {}
    for scan in ("grouped", "dense"):
        tier.set_scan(scan)
        found[scan] = index.search(q, K)
    np.testing.assert_allclose(found["dense"].scores, found["grouped"].scores, rtol=1e-3)
    same = np.mean(found["dense"].ids == found["grouped"].ids)
    assert same >= 0.98, same


@pytest.mark.parametrize("scan", ["grouped", "dense"])
def test_exact_during_swaps(built, scan: str) -> None:
    """Loads, evictions and reuse of freed chunks inside the dense scan's span while searches
    run: rows of lists in transit or freed are never ranked."""
    index, q = built
    config = PlacementConfig(update_every=1, max_swap_bytes=4096)
    index.access_counts.observe(np.repeat(index.assign(q, NPROBE).cluster_ids, 50, 0))
    tier = index.set_gpu_tier(tier_bytes(index, 12), device="cpu", placement=config, scan=scan)
    ref = oracle(index, q)
    assert_same(index.search(q, K), ref)
    assert tier.scan_counts[scan] == 1  # q's hottest lists were placed first
    search_during_churn(index, q, ref, rounds=20)
    tier.wait_idle()
    tier.check_integrity()


@pytest.mark.parametrize("scan", ["grouped", "dense"])
def test_upserts_and_deletes_are_visible_at_once(scan: str) -> None:
    for metric in ("ip", "l2"):
        index, q = make_index(metric)
        rng = np.random.default_rng(9)
        tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), scan=scan)
        new = (q[:5] + 1e-4 * rng.normal(size=(5, q.shape[1]))).astype(np.float32)
        index.add_documents([Document(f"new{i}", f"new {i}") for i in range(5)], new)
        assert_same(index.search(q, K), oracle(index, q))
        top = index.search(q[:5], 2).ids
        docs = index.get_documents(top.ravel().tolist())
        index.delete_documents({d.id for d in docs if d is not None})
        assert_same(index.search(q, K), oracle(index, q))
        tier.check_integrity()
        index.close()


def test_dense_span_skips_free_chunks_and_masks_them() -> None:
    """Evicting a list in the middle of the pool leaves free chunks inside the span: the dense
    scan reads them in place and never ranks their rows (here: stale vectors of that list)."""
    index, q = make_index("ip")
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), scan="dense")
    plan = index.assign(q, NPROBE)
    victim = int(plan.cluster_ids[0, 0])
    tier.evict([victim])
    tier.wait_idle()
    assert victim not in tier.clusters and tier.num_free_chunks > 0
    assert_same(index.search(q, K), oracle(index, q))
    tier.check_integrity()
    index.close()


def _h200_like_model(setting: tuple) -> ScanCostModel:
    """A model fitted from timings that follow the H200's measured law (BENCHMARKS.md, 5M x 768
    float32: exhaustive 3.6 / 10 / 54 ms at batch 1 / 32 / 256, the grouped tier 2.1 / 23 /
    55 ms at nprobe 256): dense 0.7 ns per span row + 37 ps per (query, row); grouped 2.1 ns
    per gathered row (the copy) + 1.5 ns per scored (padded query, row) slot."""
    rng = np.random.default_rng(0)
    samples = []
    for n in (1, 16, 128):
        for span in (1 << 18, 1 << 22):
            gathered = int(span * rng.uniform(0.05, 1.0))
            feats = ScanFeatures(n, span, gathered, gathered * int(rng.integers(1, n + 1)))
            dense = 1e-4 + 7e-10 * span + 3.7e-11 * n * span
            grouped = 2e-4 + 2.1e-9 * gathered + 1.5e-9 * feats.scored_rows
            samples.append(ScanSample(feats, {"dense": dense, "grouped": grouped}))
    return ScanCostModel.fit(samples, setting, 1 << 22)


def _h200_features(n: int, nprobe: int, coverage: float) -> ScanFeatures:
    """Features of a batch on the 5M x 768 IVF4096 index (about 1.2 chunks of 256 rows per
    list), ``coverage`` of the lists resident (the lowest ids), uniform probes."""
    nlist, size = 4096, 256
    rng = np.random.default_rng(n)
    counts = np.append(1 + (rng.random(nlist) < 0.2), 0)
    resident = int(coverage * nlist)
    counts[resident:nlist] = 0
    lc = np.argsort(rng.random((n, nlist)), axis=1)[:, :nprobe]
    lc = np.where(lc < resident, lc, nlist)
    plan = plan_grouped(lc, counts)
    span = int(counts.sum()) * size
    return ScanFeatures(n, span, plan.num_runs * size, plan.num_slots * size)


def test_cost_model_fit_recovers_known_coefficients() -> None:
    truth = {"dense": (2e-5, 3e-10, 1e-11), "grouped": (3e-4, 1e-9, 1e-10)}
    rng = np.random.default_rng(2)
    samples = []
    for _ in range(12):
        f = ScanFeatures(*(int(v) for v in rng.integers([1, 1e4, 1e3, 1e3], [256, 1e7, 1e6, 1e8])))
        sec = {s: float(np.dot(c, f.terms(s))) for s, c in truth.items()}
        samples.append(ScanSample(f, sec))
    model = ScanCostModel.fit(samples)
    np.testing.assert_allclose(model.dense, truth["dense"], rtol=1e-6)
    np.testing.assert_allclose(model.grouped, truth["grouped"], rtol=1e-6)
    with pytest.raises(ValueError, match="samples"):
        ScanCostModel.fit(samples[:2])
    with pytest.raises(ValueError, match="strategy"):
        model.predict("triton", samples[0].features)


def test_auto_picks_dense_for_big_batches_and_grouped_for_one_query() -> None:
    """On a calibrated model (H200-like timings): big batches with the whole index resident go
    dense; one query, probing a small share of a large tier, goes grouped. (A small tier is
    cheap to read whole: there the model may well prefer dense even for one query.)"""
    model = _h200_like_model(())
    for n, nprobe in ((256, 256), (256, 512), (64, 128)):
        assert model.choose(_h200_features(n, nprobe, 1.0)) == "dense", (n, nprobe)
    for nprobe, coverage in ((128, 0.5), (256, 0.5), (256, 1.0), (512, 1.0)):
        assert model.choose(_h200_features(1, nprobe, coverage)) == "grouped", nprobe


def test_auto_follows_its_model() -> None:
    """The tier runs, per batch, the strategy its model predicts faster on that batch."""
    index, _ = make_index("ip")
    rng = np.random.default_rng(4)
    q = rng.normal(size=(64, index.spec.dim)).astype(np.float32)
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(0, NLIST, 3), scan="grouped")
    tier.set_scan("auto")
    size = tier.chunk_size
    span = tier.features(1, plan_grouped(np.zeros((1, 1), np.int64), tier._counts_ext)).span_rows
    for cheap_dense in (True, False):  # a model with the opposite preference each time
        d, g = (1e-9, 1e-6) if cheap_dense else (1e-6, 1e-9)
        model = ScanCostModel((0.0, d, d), (0.0, g, g), tier.model_setting, span)
        assert tier.adopt_model(model)
        for n, nprobe in ((1, 2), (64, NLIST)):
            plan = index.assign(q[:n], nprobe)
            on = tier.resident_mask(plan.cluster_ids)
            if not on.any():
                continue
            lc = np.where(on, plan.cluster_ids, NLIST)
            want = model.choose(tier.features(n, plan_grouped(lc, tier._counts_ext)))
            assert want == ("dense" if cheap_dense else "grouped"), (n, size)
            before = tier.scan_counts[want]
            assert_same(index.search(q[:n], K, nprobe), oracle(index, q[:n], K, nprobe))
            assert tier.scan_counts[want] == before + 1
    index.close()


def test_calibration_fits_on_the_tier_and_is_reused() -> None:
    index, q = make_index("l2")
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST))
    model = tier.cost_model
    assert model is not None and model.setting == tier.model_setting
    assert all(c >= 0 for c in (*model.dense, *model.grouped))
    assert sum(tier.scan_counts.values()) == 0  # calibration scans are not counted
    again = index.set_gpu_tier(BIG, device="cpu", clusters=range(1, NLIST))
    assert again.cost_model is model  # same device, dtype and about the same span
    other = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), dtype="float16")
    assert other.cost_model is not model and other.cost_model is not None
    assert not other.adopt_model(model)
    empty = index.set_gpu_tier(BIG, device="cpu", clusters=[])
    assert empty.calibrate() is None
    lazy = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), scan="grouped")
    lazy.set_scan("auto")
    assert lazy.cost_model is None  # calibrated at its first scan
    assert_same(index.search(q, K), oracle(index, q))
    assert lazy.cost_model is not None and sum(lazy.scan_counts.values()) == 1
    index.close()


def test_bad_scan_is_refused() -> None:
    index, _ = make_index("ip")
    with pytest.raises(ValueError, match="scan"):
        index.set_gpu_tier(BIG, device="cpu", clusters=[0], scan="triton")
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=[0], scan="dense")
    with pytest.raises(ValueError, match="scan"):
        tier.set_scan("fast")
    with pytest.raises(ValueError, match="points"):
        tier.calibrate(((0, 0.5), (1, 0.5), (2, 0.5)))
    with pytest.raises(ValueError, match="points"):
        tier.calibrate(((1, 0.5),))
    index.close()


@pytest.mark.gpu
@pytest.mark.parametrize("scan", [*SCANS, "fused"])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_cuda_strategies_equal_faiss(metric: str, scan: str) -> None:
    index, q = make_index(metric)
    for clusters in (range(0, NLIST, 3), range(NLIST)):
        tier = index.set_gpu_tier(BIG, device="cuda", clusters=clusters, scan=scan)
        for nprobe in (1, NPROBE, NLIST):
            assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
    config = PlacementConfig(update_every=1)
    tier = index.set_gpu_tier(tier_bytes(index, 12), device="cuda", placement=config, scan=scan)
    for _ in range(5):
        assert_same(index.search(q, K), oracle(index, q))
        index.tier_updater.update_now(force=True)
    tier.wait_idle()
    tier.check_integrity()
    index.close()
