"""Cold lists streamed to the tier's device (run on CPU tensors, ``stream_cold="on"``): any
split of the cold lists between the streamer and Faiss equals Faiss's one-shot search, also
with tiny staging buffers (lists split across chunks), during swaps and after writes; the
split rule and the Eq. 1 model with streaming."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from tests.retrieval.test_gpu_tier import (
    BIG,
    DIM,
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
from ragserve.retrieval.cold_stream import StreamConfig, StreamCostModel, plan_split
from ragserve.retrieval.latency_model import PiecewiseLinear, SearchLatencyModel
from ragserve.retrieval.partition import PlacementConfig


@pytest.fixture(scope="module", params=["ip", "l2"])
def built(request):
    index, q = make_index(request.param)
    yield index, q
    index.drop_gpu_tier()


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("stage_bytes", [100 * (DIM * 4 + 8), 64 << 20])
def test_any_split_equals_faiss(built, share: float, stage_bytes: int) -> None:
    index, q = built
    stream = StreamConfig(mode="on", share=share, stage_bytes=stage_bytes)
    for clusters in ([], list(range(0, NLIST, 3))):  # NOTE: grouped: no scan calibration
        tier = index.set_gpu_tier(
            BIG, device="cpu", clusters=clusters, stream_cold=stream, scan="grouped"
        )
        for nprobe in (1, NPROBE, NLIST):
            assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
        streamer = tier.streamer
        assert streamer is not None and streamer.pinned_bytes == 0  # CPU: nothing pinned
        assert (streamer.num_lists > 0) == (share > 0)
        tier.check_integrity()


def test_cost_model_split_is_exact_and_calibrated(built) -> None:
    index, q = built
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(0, NLIST, 4), stream_cold="on")
    assert tier.streamer.model is None
    assert_same(index.search(q, K), oracle(index, q))
    model = tier.streamer.model  # calibrated on first use
    assert model is not None and model.threads >= 1
    assert min(model.cpu_s_per_row, model.stream_s_per_byte) >= 0
    assert_same(index.search(q, K, NLIST), oracle(index, q, K, NLIST))


def test_a_tier_holding_every_list_allocates_no_stream_buffers(built) -> None:
    index, q = built
    stream = StreamConfig(mode="on", share=1.0)
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), stream_cold=stream)
    assert_same(index.search(q, K, NLIST), oracle(index, q, K, NLIST))
    streamer = tier.streamer
    assert streamer is not None and not streamer._allocated and streamer.num_batches == 0
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=[1], stream_cold=stream)
    assert not tier.streamer._allocated  # buffers come with the first streamed batch
    assert_same(index.search(q, K, NLIST), oracle(index, q, K, NLIST))
    assert tier.streamer._allocated and tier.streamer.num_batches >= 1


def test_stream_modes(built) -> None:
    index, _ = built
    assert index.set_gpu_tier(BIG, device="cpu", clusters=[1]).streamer is None  # auto: not on CPU
    assert index.set_gpu_tier(BIG, device="cpu", clusters=[1], stream_cold="auto").streamer is None
    with pytest.raises(ValueError, match="stream_cold must be one of"):
        index.set_gpu_tier(BIG, device="cpu", clusters=[1], stream_cold="always")
    with pytest.raises(ValueError, match="share must be in"):
        StreamConfig(mode="on", share=1.5)
    with pytest.raises(ValueError, match="host_budget_bytes and stage_bytes"):
        StreamConfig(host_budget_bytes=0)


def test_host_budget_bounds_the_staging(built) -> None:
    index, q = built
    row = DIM * 4 + 8
    stream = StreamConfig(mode="on", share=1.0, host_budget_bytes=2 * 50 * row)
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=[], stream_cold=stream)
    assert tier.streamer.stage_rows == 50  # two buffers within the budget
    assert_same(index.search(q, K), oracle(index, q))


def test_exact_during_swaps_and_after_writes(built) -> None:
    index, q = built
    config = PlacementConfig(update_every=1, max_swap_bytes=4096)
    stream = StreamConfig(mode="on", share=0.5, stage_bytes=300 * (DIM * 4 + 8))
    tier = index.set_gpu_tier(
        tier_bytes(index, 12), device="cpu", placement=config, stream_cold=stream
    )
    ref = oracle(index, q)
    search_during_churn(index, q, ref, rounds=20)
    assert tier.streamer.num_batches > 0
    rng = np.random.default_rng(9)
    new = (q[:5] + 1e-4 * rng.normal(size=(5, DIM))).astype(np.float32)
    index.add_documents([Document(f"s{i}", f"new {i}") for i in range(5)], new)
    assert_same(index.search(q, K), oracle(index, q))
    top = index.search(q[:5], 2).ids
    docs = index.get_documents(top.ravel().tolist())
    index.delete_documents({d.id for d in docs if d is not None})
    assert_same(index.search(q, K), oracle(index, q))
    assert np.array_equal(tier.streamer.list_rows, index.cluster_sizes())
    tier.wait_idle()
    tier.check_integrity()
    index.check_integrity()


def test_split_streams_the_most_probed_lists_until_both_sides_meet() -> None:
    rows = np.full(8, 100)
    cold = np.array([[0, 1, 2, -1], [0, 1, 3, 4], [0, 5, 6, 7]])
    # list 0: 3 queries, list 1: 2, the rest 1 each
    assert plan_split(cold, rows, 10, 3, None).size == 0  # no model: nothing streamed
    assert plan_split(cold, rows, 10, 3, None, share=0.25).tolist() == [0, 1]
    free_gpu = StreamCostModel(1.0, 1.0, 0.0, 0.0, threads=1)
    assert plan_split(cold, rows, 10, 3, free_gpu).tolist() == list(range(8))
    free_cpu = StreamCostModel(0.0, 0.0, 1.0, 1.0, threads=1)
    assert plan_split(cold, rows, 10, 3, free_cpu).size == 0
    # CPU 1 s per probed row (3 threads: /3), stream 1 s per 10 bytes (= one row at 10 B):
    # streaming list 0 (100 rows) costs 100 s and saves 100 s of CPU; the optimum balances.
    even = StreamCostModel(0.0, 1.0, 0.0, 0.1, threads=3)
    take = plan_split(cold, rows, 10, 3, even)
    finish = [
        max(even.stream_seconds(100 * 10 * j), even.cpu_seconds(_work(cold, j, rows), 3))
        for j in range(9)
    ]
    assert len(take) == int(np.argmin(finish))
    assert take.tolist() == list(range(8))[: len(take)]


def _work(cold: np.ndarray, j: int, rows: np.ndarray) -> float:
    lists, m = np.unique(cold[cold >= 0], return_counts=True)
    order = np.lexsort((lists, -m))
    return float((rows[lists[order]] * m[order])[j:].sum())


def test_streamed_eq1_model(bench_module) -> None:
    StreamedLatencyModel = bench_module("tier_models").StreamedLatencyModel
    base = SearchLatencyModel(
        256, PiecewiseLinear((1.0, 64.0), (0.001, 0.01)), PiecewiseLinear((1.0, 64.0), (0.1, 2.0))
    )
    none = StreamedLatencyModel(base, StreamCostModel(0.0, 0.0, 0.0, 1e-30), bytes_per_probe=1.0)
    slow = StreamedLatencyModel(base, StreamCostModel(0.0, 0.0, 10.0, 1.0), bytes_per_probe=1e9)
    for b, eta in ((1, 0.0), (32, 0.5), (64, 0.9)):
        plain = base.hybrid_seconds(b, eta)
        assert slow.hybrid_seconds(b, eta) == pytest.approx(plain)  # streaming never helps
        assert none.hybrid_seconds(b, eta) == pytest.approx(base.cq_seconds(b), abs=1e-9)
    even = StreamedLatencyModel(base, StreamCostModel(0.0, 0.0, 0.0, 1.0), bytes_per_probe=1.0)
    lut = base.lut_seconds(64)
    g = 64 * 256 * 1.0  # streaming all cold probes: equal to the CPU only if lut == g
    expect = base.cq_seconds(64) + 0.5 * lut * g / (lut + g)
    assert even.hybrid_seconds(64, 0.5) == pytest.approx(expect)
    # the inverse: the smallest eta meeting a budget gives that budget back
    mid = StreamedLatencyModel(base, StreamCostModel(0.0, 0.0, 0.05, 1e-7), bytes_per_probe=1e5)
    for b, seconds in ((8, 0.2), (64, 0.8)):
        eta = mid.required_hit_rate(b, seconds)
        assert eta is not None and eta <= base.required_hit_rate(b, seconds)
        if eta > 0:
            assert mid.hybrid_seconds(b, eta) == pytest.approx(seconds, rel=1e-6)
    assert mid.required_hit_rate(64, 0.0001) is None  # below T_CQ: infeasible


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_cuda_stream_equals_faiss(metric: str) -> None:
    """The CUDA path: pinned bounce buffers, side-stream copies, any split, the cost model."""
    index, q = make_index(metric)
    for share in (0.0, 0.5, 1.0, None):
        stream = StreamConfig(mode="on", share=share, stage_bytes=300 * (DIM * 4 + 8))
        tier = index.set_gpu_tier(
            BIG, device="cuda", clusters=range(0, NLIST, 3), stream_cold=stream
        )
        assert tier.streamer.pinned_bytes == 0  # the buffers come with the first batch
        for nprobe in (1, NPROBE, NLIST):
            assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
        # share None: the cost model's calibration streamed; 0.0: nothing ever streamed
        assert tier.streamer.pinned_bytes == (0 if share == 0.0 else 2 * 300 * (DIM * 4 + 8))
    assert index.gpu_tier.streamer.model is not None
    auto = index.set_gpu_tier(BIG, device="cuda", clusters=[0, 1], stream_cold="auto")
    assert auto.streamer is not None  # "auto" streams on CUDA
    index.close()


def test_algorithm_1_and_eq2_price_the_streamed_path(bench_module) -> None:
    """With a stream that helps, Algorithm 1 needs no more coverage and Eq. 2's modelled
    ``T_R`` is no lower at any tier size; with one that never pays, both are unchanged."""
    StreamedLatencyModel = bench_module("tier_models").StreamedLatencyModel
    from ragserve.retrieval.partition import PartitionConfig, partition

    modelled_retrieval_profile = bench_module("eq2_model").modelled_retrieval_profile

    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, 512).astype(np.float64)
    cbytes = np.full(512, 1 << 20, np.int64)
    base = SearchLatencyModel(
        64, PiecewiseLinear((1.0, 64.0), (0.001, 0.01)), PiecewiseLinear((1.0, 64.0), (0.02, 1.0))
    )
    fast = StreamedLatencyModel(
        base, StreamCostModel(0.0, 0.0, 0.001, 1e-11), bytes_per_probe=1 << 20
    )
    never = StreamedLatencyModel(
        base, StreamCostModel(0.0, 0.0, 100.0, 1e-11), bytes_per_probe=1 << 20
    )
    config = PartitionConfig(slo_seconds=0.4, throughput=200.0, max_variance=0.05)
    plain = partition(base, counts, cbytes, config)
    assert len(partition(fast, counts, cbytes, config).cluster_ids) < len(plain.cluster_ids)
    assert partition(never, counts, cbytes, config).cluster_ids == plain.cluster_ids
    sizes = [0, 64 << 20, 256 << 20]
    rps = {
        name: modelled_retrieval_profile(m, counts, cbytes, 0.05, sizes, batch_size=16)
        for name, m in (("base", base), ("fast", fast), ("never", never))
    }
    for i in range(len(sizes)):
        got = [rps[n].requests_per_second[i] for n in ("base", "fast", "never")]
        assert got[1] >= got[0] and got[2] == pytest.approx(got[0])
    assert rps["fast"].requests_per_second[0] > rps["base"].requests_per_second[0]


def _lut_model(lut_at_64: float = 2.0) -> SearchLatencyModel:
    return SearchLatencyModel(
        256,
        PiecewiseLinear((1.0, 64.0), (0.001, 0.01)),
        PiecewiseLinear((1.0, 64.0), (lut_at_64 / 64, lut_at_64)),
    )


def test_without_split_pricing_the_streamed_model_is_the_balanced_closed_form(bench_module) -> None:
    """No router pricing (``rows_per_probe``): the router balances at ``T_LUT``'s pace, the
    closed form ``T_CQ + min(m L, L (s0 + m g) / (L + g))``; a pricing at ``T_LUT``'s pace is
    the same."""
    StreamedLatencyModel = bench_module("tier_models").StreamedLatencyModel
    rng = np.random.default_rng(3)
    base = _lut_model()
    for _ in range(50):
        b, eta = int(rng.integers(1, 65)), float(rng.uniform())
        s0, s1, bpp = rng.uniform(0, 0.3), 10 ** rng.uniform(-11, -9), 10 ** rng.uniform(5, 7)
        ds = float(rng.uniform(0.3, 1.0))
        model = StreamedLatencyModel(base, StreamCostModel(0.0, 0.0, s0, s1), bpp, ds)
        lut, g, m = base.lut_seconds(b), b * 256 * bpp * ds * s1, 1.0 - eta
        expect = base.cq_seconds(b) + min(m * lut, lut * (s0 + m * g) / (lut + g))
        assert model.hybrid_seconds(b, eta) == pytest.approx(expect, rel=1e-9, abs=1e-12)
        # the router priced at T_LUT's pace: L_r = c1 * b * 256 * rpp / min(b, threads)
        rpp = 100.0
        same = StreamCostModel(0.0, lut * min(b, 4) / (b * 256 * rpp), s0, s1, threads=4)
        priced = StreamedLatencyModel(base, same, bpp, ds, rows_per_probe=rpp)
        assert priced.hybrid_seconds(b, eta) == pytest.approx(expect, rel=1e-9, abs=1e-12)


def test_split_pricing_predicts_the_split_plan_split_makes(bench_module) -> None:
    """The oracle is the router's own rule: ``plan_split`` under a ``StreamCostModel`` whose
    CPU pace is 2x (or 0.5x) the real one; each side then takes its real time. One list a
    probe (distinct share 1), equal sizes: the model's streamed share and latency are
    ``plan_split``'s to one list's granularity."""
    StreamedLatencyModel = bench_module("tier_models").StreamedLatencyModel
    n, w, rows, row_bytes = 48, 64, 1000, 3080
    cold = np.arange(n * w).reshape(n, w)  # every probe its own cold list
    list_rows = np.full(n * w, rows)
    real_s_per_row = 2e-7  # the CPU's real pace (one thread), seconds per probed row
    base = SearchLatencyModel(
        w,
        PiecewiseLinear((1.0, 64.0), (0.0, 0.0)),
        PiecewiseLinear((1.0, 64.0), (real_s_per_row * w * rows, real_s_per_row * 64 * w * rows)),
    )
    for router_pace in (0.5, 1.0, 2.0):  # the router's CPU rate over the real one
        cost = StreamCostModel(0.0, real_s_per_row * router_pace, 0.002, 5e-11, threads=1)
        take = plan_split(cold, list_rows, row_bytes, n, cost)
        streamed = len(take) * rows * row_bytes
        real = max(cost.stream_seconds(streamed), real_s_per_row * (n * w - len(take)) * rows)
        model = StreamedLatencyModel(base, cost, rows * row_bytes, 1.0, rows_per_probe=rows)
        y = float(model.streamed_shares(np.asarray([n]), np.asarray([1.0]))[0])
        assert abs(y * n * w - len(take)) <= 1.0
        one_list = max(cost.stream_s_per_byte * rows * row_bytes, real_s_per_row * rows)
        assert model.hybrid_seconds(n, 0.0) == pytest.approx(real, abs=one_list)
        balanced = StreamedLatencyModel(base, cost, rows * row_bytes, 1.0)
        if router_pace == 1.0:
            assert model.hybrid_seconds(n, 0.0) == pytest.approx(balanced.hybrid_seconds(n, 0.0))
        else:  # a mispriced split finishes later than the balanced one
            assert model.hybrid_seconds(n, 0.0) > balanced.hybrid_seconds(n, 0.0) * 1.1


def test_split_pricing_inverse_and_algorithm_1(bench_module) -> None:
    """``required_hit_rate`` inverts ``hybrid_seconds`` with a mispriced split, and Algorithm 1
    needs at least the coverage of the balanced model under it."""
    StreamedLatencyModel = bench_module("tier_models").StreamedLatencyModel
    from ragserve.retrieval.partition import PartitionConfig, partition

    base = _lut_model(1.0)
    fast_router = StreamCostModel(0.0, 1e-8, 0.001, 1e-10, threads=14)  # CPU well below T_LUT
    skew = StreamedLatencyModel(base, fast_router, 2e6, 0.8, rows_per_probe=500.0)
    even = StreamedLatencyModel(base, fast_router, 2e6, 0.8)
    for b, seconds in ((8, 0.05), (48, 0.4), (64, 0.3)):
        eta = skew.required_hit_rate(b, seconds)
        assert eta is not None and eta >= even.required_hit_rate(b, seconds) - 1e-9
        if eta > 0:
            assert skew.hybrid_seconds(b, eta) == pytest.approx(seconds, rel=1e-6)
    assert skew.required_hit_rate(64, 0.0001) is None  # below T_CQ: infeasible
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, 512).astype(np.float64)
    cbytes = np.full(512, 1 << 20, np.int64)
    config = PartitionConfig(slo_seconds=0.4, throughput=200.0, max_variance=0.05)
    got = len(partition(skew, counts, cbytes, config).cluster_ids)
    assert got >= len(partition(even, counts, cbytes, config).cluster_ids)
    with pytest.raises(ValueError, match="StreamCostModel"):
        StreamCostModel(0.0, 1e-8, 0.001, 1e-10, threads=0)


def test_calibration_assumes_the_scans_real_parallelism(built) -> None:
    """``stepwise.scan`` slices a batch over ``stepwise.scan_threads()`` (Faiss's OpenMP
    threads by default; 1 when switched to the one-thread scan): the calibrated model's
    ``threads`` follows it unless told otherwise."""
    import faiss

    from ragserve.retrieval import stepwise
    from ragserve.retrieval.index_tier import scan_threads

    index, _ = built
    ivf = index._index
    omp = max(1, faiss.omp_get_max_threads())
    previous = stepwise.set_scan_threads(None)
    try:
        assert ivf.parallel_mode == 0 and scan_threads(ivf) == stepwise.scan_threads() == omp
        stepwise.set_scan_threads(1)
        assert scan_threads(ivf) == 1
        ivf.parallel_mode = 3  # Faiss's own split over its OpenMP threads
        assert scan_threads(ivf) == omp
        ivf.parallel_mode = 0
        index.set_gpu_tier(BIG, device="cpu", clusters=range(0, NLIST, 4), stream_cold="on")
        points = ((4, 2), (8, 4))
        assert index.calibrate_stream(points=points, repeats=1).threads == 1
        stepwise.set_scan_threads(3)
        split = stepwise.split_threads
        asked = []  # the threads each point's scan had divide its rows (a small one is not split)

        def record(*args):
            if sys._getframe(1).f_code.co_name == "_calibrate_stream":
                asked.append(args[1:])
            return split(*args)

        stepwise.split_threads = record
        try:
            assert index.calibrate_stream(points=points, repeats=1).threads == 3
        finally:
            stepwise.split_threads = split
        assert asked == list(points)
    finally:
        ivf.parallel_mode = 0
        stepwise.set_scan_threads(previous)
    assert index.calibrate_stream(points=points, repeats=1, threads=14).threads == 14
    with pytest.raises(ValueError, match="threads must be >= 1"):
        index.calibrate_stream(points=points, repeats=1, threads=0)
