"""GPU tier (run on CPU tensors): any placement, split and order equals Faiss's one-shot search;
so do searches during swaps and right after upserts and deletes."""

from __future__ import annotations

import threading

import faiss
import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.partition import PlacementConfig
from ragserve.retrieval.staged import StagedSearch, StageParams

DIM, NUM, NLIST, K, NPROBE = 16, 1500, 32, 10, 8
BIG = 1 << 30


def _clustered(rng: np.random.Generator, n: int, centers: np.ndarray) -> np.ndarray:
    pick = rng.integers(0, len(centers), n)
    return (centers[pick] + 0.4 * rng.normal(size=(n, centers.shape[1]))).astype(np.float32)


def make_index(
    metric: str, kind: str = "ivf_flat", *, duplicates: bool = False
) -> tuple[VectorIndex, np.ndarray]:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(NLIST, DIM)).astype(np.float32)
    x = _clustered(rng, NUM, centers)
    if duplicates:
        x[100:106] = x[7]  # seven equal vectors: a tie across the k-th boundary
    docs = [Document(f"d{i}", f"passage {i}") for i in range(NUM)]
    index = VectorIndex.from_vectors(
        docs, x, embedder_name="none", nlist=NLIST, kind=kind, metric=metric, nprobe=NPROBE
    )
    q = np.concatenate([x[7:8] + 1e-3, _clustered(rng, 39, centers)])
    return index, q


def oracle(index: VectorIndex, q: np.ndarray, k: int = K, nprobe: int = NPROBE):
    params = faiss.SearchParametersIVF(nprobe=nprobe)
    return index.faiss_index.search(q, k, params=params)


def assert_same(found, ref) -> None:
    ref_d, ref_i = ref
    np.testing.assert_array_equal(found.ids, ref_i)
    np.testing.assert_allclose(found.scores, ref_d, rtol=1e-5, atol=1e-5)


def search_during_churn(index, q: np.ndarray, ref, rounds: int) -> None:
    """``rounds`` searches of ``q``, each equal to ``ref``, while a thread moves the hot set
    around (access counts + forced re-placement); the thread's errors fail the test too."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        rng = np.random.default_rng(11)
        try:
            while not stop.is_set():
                hot = rng.choice(NLIST, 6, replace=False)
                index.access_counts.observe(np.repeat(hot[None, :], 50, 0))
                index.tier_updater.update_now(force=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(rounds):
            assert_same(index.search(q, K), ref)
    finally:
        stop.set()
        t.join()
    assert not errors


@pytest.fixture(scope="module", params=["ip", "l2"])
def built(request):
    index, q = make_index(request.param)
    yield index, q
    index.drop_gpu_tier()


@pytest.mark.parametrize("assign", ["faiss", "tier"])
@pytest.mark.parametrize("placement", ["none", "half", "random", "all"])
def test_any_placement_equals_faiss(built, placement: str, assign: str) -> None:
    index, q = built
    rng = np.random.default_rng(3)
    clusters = {
        "none": [],
        "half": list(range(0, NLIST, 2)),
        "random": rng.choice(NLIST, 11, replace=False).tolist(),
        "all": list(range(NLIST)),
    }[placement]
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=clusters, assign=assign)
    assert (tier.assigner is not None) == (assign == "tier")
    assert tier.clusters == tuple(sorted(clusters))
    assert index.gpu_tier is tier and tier.device == "cpu"
    assert (tier.num_bytes > 0) == bool(clusters)  # a pinned tier allocates what it needs
    for nprobe in (1, NPROBE, NLIST):
        assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
    assert_same(index.search(q[:1], 3), oracle(index, q[:1], 3))
    if tier.assigner is not None:
        assert tier.assigner.num_rows == 3 * len(q) + 1
    tier.check_integrity()


@pytest.mark.parametrize("gamma", [1e-3, 1e-2, 1e-1, 10.0])
def test_tier_assignment_with_wide_bands_equals_faiss(built, monkeypatch, gamma: float) -> None:
    """Widened error bounds put many clusters in the band: the band is scanned apart, rows it
    could change are searched again with Faiss's assignment, and the ids stay Faiss's."""
    index, q = built
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(0, NLIST, 2), assign="tier")
    monkeypatch.setattr(tier.assigner, "_gamma", gamma)
    for nprobe in (1, NPROBE, NLIST - 1):
        assert_same(index.search(q, K, nprobe), oracle(index, q, K, nprobe))
    assert tier.assigner.num_band_rows > 0
    if gamma >= 1e-1:
        assert tier.assigner.num_fallback_rows > 0


def test_hit_rate_counts_resident_probes(built) -> None:
    index, q = built
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST))
    index.search(q, K)
    assert tier.hit_rate == 1.0
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=[])
    index.search(q, K)
    assert tier.hit_rate == 0.0


def test_any_split_and_order_equals_faiss(built) -> None:
    index, q = built
    rng = np.random.default_rng(5)
    index.set_gpu_tier(BIG, device="cpu", clusters=rng.choice(NLIST, 16, replace=False))
    plan = index.assign(q, NPROBE)
    ref = oracle(index, q)
    for num_steps in (2, 3, NPROBE):
        steps = plan.split(num_steps)
        rng.shuffle(steps)
        state = None
        for step in steps:
            state = index.scan(q, step, K, state)
        assert_same(state, ref)
    ranks = np.argsort(rng.random(plan.cluster_ids.shape), axis=1)  # per-query order
    state = None
    for a in range(0, NPROBE, 3):
        state = index.scan(q, plan.take(ranks[:, a : a + 3]), K, state)
    assert_same(state, ref)


def test_staged_search_routes_resident_lists_without_splitting(built) -> None:
    index, q = built
    index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST // 2))
    search = StagedSearch(index)
    search.cost.seconds_per_vector = 1.0  # the budget counts CPU vectors
    search.cost.observe_scan = lambda *args: None
    for i, row in enumerate(q):
        search.add(f"q{i}", row, StageParams(k=K, nprobe=NPROBE, budget_s=50.0))
    plan = index.assign(q, NPROBE)
    all_gpu = index.resident_mask(plan.cluster_ids).all(1)
    done: dict[str, object] = {}
    first_step = search.step()
    for p in first_step:
        if p.done:
            done[p.key] = p
    # early completion: a query whose lists are all resident finishes in its first sub-stage
    assert all(f"q{i}" in done for i in np.flatnonzero(all_gpu))
    while search.has_pending():
        for p in search.step():
            if p.done:
                done[p.key] = p
    ref_d, ref_i = oracle(index, q)
    for i in range(len(q)):
        state = done[f"q{i}"].state
        np.testing.assert_array_equal(state.ids[0], ref_i[i])
        np.testing.assert_allclose(state.scores[0], ref_d[i], rtol=1e-5, atol=1e-5)


def test_exact_during_swaps(built) -> None:
    index, q = built
    config = PlacementConfig(update_every=1, max_swap_bytes=4096)
    tier = index.set_gpu_tier(tier_bytes(index, 12), device="cpu", placement=config)
    ref = oracle(index, q)
    search_during_churn(index, q, ref, rounds=30)
    assert index.tier_updater.num_replans > 1
    tier.wait_idle()
    tier.check_integrity()


def test_upserts_and_deletes_are_visible_at_once(built) -> None:
    index, q = built
    rng = np.random.default_rng(9)
    tier = index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST))
    new = (q[:5] + 1e-4 * rng.normal(size=(5, DIM))).astype(np.float32)
    index.add_documents([Document(f"new{i}", f"new {i}") for i in range(5)], new)
    assert_same(index.search(q, K), oracle(index, q))
    assert len(tier.clusters) < NLIST  # changed lists left the tier
    top = index.search(q[:5], 2).ids
    docs = index.get_documents(top.ravel().tolist())
    index.delete_documents({d.id for d in docs if d is not None})
    assert_same(index.search(q, K), oracle(index, q))
    index.add_documents([Document("d7", "replaced")], new[:1])  # upsert of an existing id
    assert_same(index.search(q, K), oracle(index, q))
    tier.check_integrity()
    index.check_integrity()


def test_updater_places_the_hot_lists_again(built) -> None:
    index, q = built
    tier = index.set_gpu_tier(tier_bytes(index, 10), device="cpu")
    hot = [3, 5, 8]
    index.access_counts.observe(np.tile(np.array(hot), (5000, 1)))
    index.tier_updater.update_now(force=True)
    tier.wait_idle()
    assert set(hot) <= set(tier.clusters)
    index.search(q, K)
    tier.check_integrity()


def test_drift_in_the_live_stream_moves_the_tier(built) -> None:
    """No forced round: the updater's drift detector fires on the live counts alone, and the
    new placement serves more of the probes (a higher hit rate), exactly."""
    index, q = built
    index.access_counts = type(index.access_counts)(NLIST)  # a fresh stream
    config = PlacementConfig(update_every=1)
    tier = index.set_gpu_tier(tier_bytes(index, 8), device="cpu", placement=config)
    start = set(tier.clusters)
    plan = index.assign(q, NPROBE)
    hot = [c for c in np.unique(plan.cluster_ids) if c not in start][:3]
    assert hot
    rows = np.tile(np.array(hot), (400, 1))
    for _ in range(6):  # each search wakes the background updater (update_every=1)
        index.access_counts.observe(rows)
        assert_same(index.search(q, K), oracle(index, q))
        index.tier_updater.update_now()
    tier.wait_idle()
    assert index.tier_updater.num_replans >= 1
    assert set(hot) <= set(tier.clusters)  # the hot probes' hit rate went from 0 to 1
    assert index.resident_mask(rows).all()
    assert_same(index.search(q, K), oracle(index, q))
    tier.check_integrity()


def test_algorithm_1_places_the_smallest_coverage_meeting_the_slo(built) -> None:
    from ragserve.retrieval.latency_model import SearchLatencyModel
    from ragserve.retrieval.partition import PartitionConfig, partition

    index, q = built
    index.access_counts = type(index.access_counts)(NLIST)
    index.access_counts.observe(index.assign(q, NPROBE).cluster_ids)
    batches = [1, 8, 32, 64]
    model = SearchLatencyModel.fit(
        NPROBE, batches, [1e-4 * b for b in batches], [2e-3 * b for b in batches]
    )
    for slo in (0.02, 0.05, 1.0):
        config = PlacementConfig(
            latency_model=model,
            partition=PartitionConfig(slo_seconds=slo, throughput=200.0, max_variance=0.01),
        )
        tier = index.set_gpu_tier(BIG, device="cpu", placement=config)
        chunk = 256 * (DIM * 4 + 12)
        sizes = index.cluster_sizes()
        want = partition(
            model,
            index.access_counts.snapshot(),
            np.where(sizes > 0, np.ceil(sizes / 256) * chunk, 0).astype(np.int64),
            PartitionConfig(slo, 200.0, 0.01, budget_bytes=tier.capacity_chunks * chunk),
        )
        assert tier.clusters == tuple(sorted(want.cluster_ids)), slo
        assert_same(index.search(q, K), oracle(index, q))


@pytest.mark.parametrize(("metric", "dtype"), [("ip", "float16"), ("l2", "bfloat16")])
def test_half_precision_recall(metric: str, dtype: str) -> None:
    """Each half dtype once, under each metric once (the scan is the same code for both)."""
    index, q = make_index(metric)
    _, ref_i = oracle(index, q)
    index.set_gpu_tier(BIG, device="cpu", clusters=range(NLIST), dtype=dtype)
    found = index.search(q, K).ids
    recall = np.mean([len(set(a) & set(b)) / K for a, b in zip(found, ref_i, strict=True)])
    assert recall >= 0.9, (dtype, recall)
    index.close()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_equal_vectors_tie_within_rounding(metric: str) -> None:
    """NOTE: the tier's matmul may score bit-equal vectors an ulp apart (BLAS tiles), so among
    exact ties Faiss's id order is not guaranteed; the top-k is still correct up to ties."""
    index, q = make_index(metric, duplicates=True)
    index.set_gpu_tier(BIG, device="cpu", clusters=range(0, NLIST, 2))
    ref_d, _ = oracle(index, q)
    found = index.search(q, K)
    np.testing.assert_allclose(found.scores, ref_d, rtol=1e-5, atol=1e-5)
    row_ids, vectors = index._store.vectors()
    x = vectors[np.searchsorted(row_ids, found.ids[0])]
    exact = x @ q[0] if metric == "ip" else ((x - q[0]) ** 2).sum(1)
    np.testing.assert_allclose(exact, ref_d[0], rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused(built) -> None:
    index, _ = built
    with pytest.raises(ValueError, match="clusters"):
        index.set_gpu_tier(BIG, device="cpu", clusters=[NLIST])
    with pytest.raises(ValueError, match="budget_bytes"):
        index.set_gpu_tier(1000, device="cpu", clusters=[0, 1])
    with pytest.raises(ValueError, match="budget_bytes"):
        index.set_gpu_tier(-1, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        index.set_gpu_tier(BIG, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="assign"):
        index.set_gpu_tier(BIG, device="cpu", assign="gpu")
    sq8, _ = make_index("ip", kind="ivf_sq8")
    with pytest.raises(ValueError, match="kind"):
        sq8.set_gpu_tier(BIG, device="cpu")
    index.drop_gpu_tier()
    assert index.gpu_tier is None


def tier_bytes(index: VectorIndex, num_lists: int) -> int:
    """Bytes for about ``num_lists`` average lists (chunks of 256 rows, float32)."""
    per_chunk = 256 * (DIM * 4 + 12)
    chunks = int(np.ceil(index.cluster_sizes() / 256).mean() * num_lists)
    return chunks * per_chunk


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_cuda_tier_equals_faiss(metric: str) -> None:
    index, q = make_index(metric)
    for clusters in ([], range(0, NLIST, 3), range(NLIST)):
        for assign in ("faiss", "tier"):
            index.set_gpu_tier(BIG, device="cuda", clusters=clusters, assign=assign)
            assert_same(index.search(q, K), oracle(index, q))
            assert_same(index.search(q, K, NLIST // 2), oracle(index, q, K, NLIST // 2))
    index.set_gpu_tier(tier_bytes(index, 12), device="cuda", placement=PlacementConfig(1))
    for _ in range(5):
        assert_same(index.search(q, K), oracle(index, q))
        index.tier_updater.update_now(force=True)
    index.close()


def test_a_budget_pick_at_the_tiers_chunk_prices_always_loads():
    """Lists of 1-2 rows past a chunk boundary: priced by raw bytes, a budget pick overfills
    the tier (the 2026-12-01 H200 failure's class); priced by ``tier_list_bytes``, every pick
    of ``fill_budget`` / Algorithm 1 loads pinned, and one more list would not fit."""
    from ragserve.retrieval import stepwise
    from ragserve.retrieval.docstore import DocStore
    from ragserve.retrieval.gpu_tier import tier_chunk_bytes, tier_list_bytes
    from ragserve.retrieval.index import IndexSpec
    from ragserve.retrieval.latency_model import PiecewiseLinear, SearchLatencyModel
    from ragserve.retrieval.partition import PartitionConfig, fill_budget, partition

    rng = np.random.default_rng(3)
    nlist, rows = 6, [257, 258, 513, 1, 300, 769]
    centers = 50.0 * np.eye(nlist, DIM, dtype=np.float32)
    x = np.concatenate([centers[c] + rng.normal(size=(n, DIM)) for c, n in enumerate(rows)])
    ivf = stepwise.make_ivf(DIM, nlist, "ivf_flat", "ip")
    ivf.quantizer.add(centers)  # the lists are exactly ``rows``
    ivf.is_trained = True
    ivf.add(x.astype(np.float32))
    index = VectorIndex(ivf, DocStore(None), IndexSpec(DIM, nlist, "ivf_flat", "ip", "none", 2))
    sizes = index.cluster_sizes()
    assert sizes.tolist() == rows
    counts = rng.permutation(nlist).astype(np.float64) + 1.0
    priced = tier_list_bytes(sizes, DIM)
    np.testing.assert_array_equal(priced // tier_chunk_bytes(DIM), -(-sizes // 256))
    raw = sizes * (DIM * 4 + 8 + 4)
    slow = PiecewiseLinear((1.0, 2.0), (1.0, 2.0))
    model = SearchLatencyModel(2, slow, slow)  # no coverage meets the SLO: the budget decides
    overfilled = 0
    for budget in range(0, int(priced.sum()) + 1, tier_chunk_bytes(DIM) // 2):
        config = PartitionConfig(0.01, 100.0, 0.05, budget_bytes=budget)
        for plan in (fill_budget(counts, priced, budget), partition(model, counts, priced, config)):
            tier = index.set_gpu_tier(budget, device="cpu", clusters=plan.cluster_ids, scan="dense")
            assert sorted(tier.clusters) == sorted(plan.cluster_ids)
            assert plan.num_bytes <= budget
            rest = [c for c in np.argsort(-counts, kind="stable") if c not in plan.cluster_ids]
            if rest:
                with pytest.raises(ValueError, match="the given clusters need"):
                    index.set_gpu_tier(budget, device="cpu", clusters=[*plan.cluster_ids, rest[0]])
        raw_pick = fill_budget(counts, raw, budget).cluster_ids
        try:
            index.set_gpu_tier(budget, device="cpu", clusters=raw_pick, scan="dense")
        except ValueError:
            overfilled += 1
    assert overfilled > 0  # the premise: chunk rounding matters for these sizes
    index.drop_gpu_tier()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_assign_auto_measures_both_paths_per_batch_size_and_stays_exact(metric: str) -> None:
    from ragserve.retrieval.tier_assign import ASSIGN_PATHS

    index, q = make_index(metric)
    tier = index.set_gpu_tier(
        BIG, device="cpu", clusters=range(0, NLIST, 2), scan="dense", assign="auto"
    )
    chooser = tier.assign_chooser
    assert chooser is not None and tier.assigner is not None
    for size in (4, 32):
        ref = oracle(index, q[:size])
        for _ in range(2 * chooser.trials + 2):
            assert_same(index.search(q[:size], K), ref)
    assert set(chooser.choices) == {4, 32}
    assert set(chooser.choices.values()) <= set(ASSIGN_PATHS)
    for runs in chooser.seconds.values():
        assert all(len(runs[p]) == chooser.trials for p in ASSIGN_PATHS)
    assert tier.assigner.num_rows >= chooser.trials * (4 + 32)  # the tier's path ran
    assert index.set_gpu_tier(BIG, device="cpu", assign="faiss").assign_chooser is None
    index.drop_gpu_tier()
