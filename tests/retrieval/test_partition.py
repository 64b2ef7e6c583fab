"""VectorLiteRAG's hit-rate model (Beta, Eq. 2), Algorithm 1 and drift detection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ragserve.retrieval.latency_model import PiecewiseLinear, SearchLatencyModel
from ragserve.retrieval.partition import (
    BetaHitRate,
    DriftConfig,
    DriftDetector,
    PartitionConfig,
    count_accesses,
    decay_counts,
    fill_budget,
    hottest_first,
    partition,
)


@pytest.fixture(scope="module")
def calib(bench_module):
    return bench_module("tier_models")


# Stated tolerances (absolute, on hit rates in [0, 1]).
EQ2_TOL = 0.005  # Eq. 2 quadrature vs Monte-Carlo minima of Beta samples
FIT_TOL = 0.03  # method-of-moments Beta vs Monte-Carlo minima of simulated IVF queries
APPROX_TOL = 0.15  # the paper's variance approximation (sigma_max^2) vs the same minima


def simulate_probes(rng, num_queries=4000, side=16, nprobe=16, skew=1.2, perm=None):
    """IVF-like probes: clusters on a ``side x side`` grid, topics Zipf-popular (``perm``
    reassigns popularity ranks to clusters), each query probes the ``nprobe`` clusters nearest
    a point scattered around its topic. Returns (probe_ids [n, nprobe], nlist)."""
    nlist = side * side
    pos = np.stack(np.meshgrid(np.arange(side), np.arange(side)), -1).reshape(-1, 2)
    pop = 1.0 / np.arange(1, nlist + 1) ** skew
    ranks = rng.choice(nlist, size=num_queries, p=pop / pop.sum())
    topics = (np.arange(nlist) if perm is None else perm)[ranks]
    q = pos[topics] + rng.normal(scale=1.5, size=(num_queries, 2))
    dist = ((q[:, None, :] - pos[None].astype(float)) ** 2).sum(-1)
    return np.argsort(dist, axis=1, kind="stable")[:, :nprobe], nlist


def linear_model(cq=(0.001, 0.0001), lut=(0.01, 0.004), nprobe=16) -> SearchLatencyModel:
    """``T(b) = a + s b`` for both stages, as piecewise-linear functions."""
    f = lambda a, s: PiecewiseLinear((1.0, 2.0), (a + s, a + 2 * s))  # noqa: E731
    return SearchLatencyModel(nprobe, f(*cq), f(*lut))


# -- access counts -------------------------------------------------------------------------------


def test_access_counts_decay_and_hottest_order(calib):
    probes = np.array([[0, 2, -1], [2, 3, 0], [2, -1, -1]])
    counts = count_accesses(probes, 5)
    np.testing.assert_array_equal(counts, [2, 0, 3, 1, 0])
    np.testing.assert_array_equal(hottest_first(counts), [2, 0, 3, 1, 4])  # ties by id
    np.testing.assert_array_equal(decay_counts(counts, np.ones(5), 0.5), [2, 1, 2.5, 1.5, 1])
    np.testing.assert_array_equal(decay_counts(None, counts, 0.5), counts)
    on_gpu = np.array([False, False, True, False, False])
    np.testing.assert_allclose(calib.per_query_hit_rates(probes, on_gpu), [0.5, 1 / 3, 1.0])
    np.testing.assert_allclose(
        calib.per_query_hit_rates(np.array([[-1, -1], [2, 1]]), on_gpu), [0.5]
    )
    with pytest.raises(ValueError, match="nlist"):
        count_accesses(probes, 3)
    with pytest.raises(ValueError, match="decay"):
        decay_counts(counts, counts, 0.0)
    with pytest.raises(ValueError, match="shape"):
        decay_counts(counts, np.ones(4), 0.5)
    with pytest.raises(ValueError, match="access_counts"):
        hottest_first(np.array([1.0, -1.0]))


# -- Beta model (Eq. 2) --------------------------------------------------------------------------


def test_method_of_moments_recovers_beta_parameters(calib):
    rng = np.random.default_rng(1)
    fit = calib.fit_beta(rng.beta(2.0, 5.0, size=200_000))
    assert fit.alpha == pytest.approx(2.0, rel=0.05)
    assert fit.beta == pytest.approx(5.0, rel=0.05)
    point = calib.fit_beta(np.full(10, 0.25))
    assert point.is_point_mass and point.alpha is None and point.expected_min(64) == 0.25
    bernoulli = calib.fit_beta(np.array([0.0, 1.0, 1.0, 0.0]))  # past the Beta limit: clamped
    assert 0 < bernoulli.variance < 0.25 and bernoulli.alpha < 1e-3


@pytest.mark.parametrize("a, b", [(2.85, 6.65), (0.3, 0.7), (40.0, 8.0), (0.8, 3.0)])
def test_eq2_expected_minimum_matches_monte_carlo(a, b):
    rng = np.random.default_rng(2)
    mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
    dist = BetaHitRate(mean, var)
    assert (dist.alpha, dist.beta) == pytest.approx((a, b))
    xs = np.linspace(0.05, 0.95, 7)
    samples = rng.beta(a, b, size=400_000)
    np.testing.assert_allclose(dist.cdf(xs), [(samples <= x).mean() for x in xs], atol=EQ2_TOL)
    for batch in (1, 4, 16, 64):
        mc = rng.beta(a, b, size=(20_000, batch)).min(axis=1).mean()
        assert abs(dist.expected_min(batch) - mc) < EQ2_TOL, batch
    mins = dist.expected_mins(np.arange(1, 65))
    assert np.all(np.diff(mins) <= 1e-12)  # order statistics: the tail falls with B


def test_beta_tail_estimate_matches_simulated_ivf_batches(calib):
    rng = np.random.default_rng(3)
    probes, nlist = simulate_probes(rng)
    order = hottest_first(count_accesses(probes, nlist))
    sigma2 = calib.profile_max_variance(probes, nlist)
    assert 0 < sigma2 < 0.25
    for k in (16, 32, 64, 128):
        on_gpu = np.zeros(nlist, dtype=bool)
        on_gpu[order[:k]] = True
        rates = calib.per_query_hit_rates(probes, on_gpu)
        fitted = calib.fit_beta(rates)
        approx = BetaHitRate.from_mean(float(rates.mean()), sigma2)
        for batch in (1, 4, 16, 32):
            mc = rates[rng.integers(0, len(rates), size=(20_000, batch))].min(axis=1).mean()
            assert abs(fitted.expected_min(batch) - mc) < FIT_TOL, (k, batch)
            assert abs(approx.expected_min(batch) - mc) < APPROX_TOL, (k, batch)


@pytest.mark.parametrize("a, b", [(2.85, 6.65), (0.3, 0.7), (40.0, 8.0)])
def test_pooled_batch_quantile_matches_monte_carlo(a, b):
    # the batch_mean tail: the 10th percentile of the mean of B independent draws
    rng = np.random.default_rng(6)
    mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
    dist = BetaHitRate(mean, var)
    assert dist.quantile(0.5) == pytest.approx(np.median(rng.beta(a, b, 400_000)), abs=0.005)
    tails = dist.tails(np.array([1, 4, 16, 64]))
    for batch, tail in zip((1, 4, 16, 64), tails, strict=True):
        mc = np.quantile(rng.beta(a, b, size=(40_000, batch)).mean(axis=1), 0.1)
        # moment-matched Beta for the mean of B draws: exact at B = 1, close beyond
        assert abs(tail - mc) < (0.005 if batch == 1 else 0.02), batch
    assert np.all(np.diff(tails) > 0) and tails[-1] < mean  # the pooled tail rises toward the mean
    assert dist.tail(16, "min") < dist.tail(16)  # the slowest query is below the pooled rate


def test_tail_mode_is_checked():
    with pytest.raises(ValueError, match="tail mode"):
        BetaHitRate(0.5, 0.01).tail(4, "max")
    with pytest.raises(ValueError, match="tail quantile"):
        PartitionConfig(1.0, 1.0, 0.01, tail_quantile=1.0)
    with pytest.raises(ValueError, match="q must be"):
        BetaHitRate(0.5, 0.01).quantile(0.0)
    assert BetaHitRate(0.3, 0.0).tail(8) == 0.3  # a point mass pools to itself


def test_beta_rejects_bad_parameters(calib):
    for mean, var, match in [(1.5, 0.0, "mean"), (0.5, 0.25, "variance"), (0.0, 0.1, "variance")]:
        with pytest.raises(ValueError, match=match):
            BetaHitRate(mean, var)
    with pytest.raises(ValueError, match="max_variance"):
        BetaHitRate.from_mean(0.5, 0.25)
    with pytest.raises(ValueError, match="hit_rates"):
        calib.fit_beta(np.array([0.5, 1.2]))
    with pytest.raises(ValueError, match="batch sizes"):
        BetaHitRate(0.5, 0.01).expected_mins(np.array([0]))


def _tail(counts: np.ndarray, num_clusters: int, batch: int, mode: str) -> float:
    """Tail hit rate with the first ``num_clusters`` (counts sorted hottest first)."""
    mean = counts[:num_clusters].sum() / counts.sum()
    return BetaHitRate.from_mean(mean, 0.05).tail(batch, mode)


@pytest.mark.parametrize("mode", ["batch_mean", "min"])
def test_hit_rate_to_coverage_is_the_fewest_clusters(calib, mode):
    counts = 1.0 / np.arange(1, 65) ** 1.1
    for target, batch in [(0.2, 1), (0.2, 8), (0.5, 4), (0.05, 32)]:
        k = calib.hit_rate_to_coverage(counts, 0.05, target, batch, tail_mode=mode)
        assert k is not None

        assert _tail(counts, k, batch, mode) >= target
        assert k == 0 or _tail(counts, k - 1, batch, mode) < target
    assert calib.hit_rate_to_coverage(counts, 0.05, 0.0, 8, tail_mode=mode) == 0
    # all clusters: point mass at 1
    assert calib.hit_rate_to_coverage(counts, 0.05, 1.0, 8, tail_mode=mode) == 64
    assert calib.hit_rate_to_coverage(np.zeros(8), 0.05, 0.5, 8) is None  # no accesses: no hits


# -- Algorithm 1 ---------------------------------------------------------------------------------


def _brute_force_smallest(model, counts, sizes, config) -> int | None:
    """Oracle: scan every coverage with scalar calls; the smallest feasible one."""
    order = hottest_first(counts)
    tau = config.target_seconds
    for k in range(len(counts) + 1):
        index_bytes = int(sizes[order[:k]].sum())
        if config.budget_bytes is not None and index_bytes > config.budget_bytes:
            return None
        mu = config.throughput
        if config.kv_cache_bytes is not None:
            mu *= (config.kv_cache_bytes - index_bytes) / config.kv_cache_bytes
        if mu <= 0:
            continue
        dist = BetaHitRate.from_mean(counts[order[:k]].sum() / counts.sum(), config.max_variance)
        for batch in range(1, max(1, math.ceil(tau * mu)) + 1):
            need = model.required_hit_rate(batch, min(tau, batch / mu))
            tail = dist.tail(batch, config.tail_mode, config.tail_quantile)
            if need is not None and tail >= need - 1e-12:
                return k
    return None


def random_model(rng) -> SearchLatencyModel:
    """Piecewise-linear stages with random breaks, dips included (single -> multi-thread)."""

    def stage(scale: float) -> PiecewiseLinear:
        breaks = np.sort(rng.choice(np.arange(2, 64), size=3, replace=False)).astype(float)
        values = scale * (1.0 + np.cumsum(rng.uniform(-0.3, 1.0, size=4)))
        return PiecewiseLinear((1.0, *breaks), tuple(values))

    return SearchLatencyModel(16, stage(rng.uniform(1e-4, 2e-3)), stage(rng.uniform(1e-3, 1e-2)))


@pytest.mark.parametrize("mode", ["batch_mean", "min"])
def test_partition_is_the_smallest_feasible_coverage(mode):
    rng = np.random.default_rng(4)
    for trial in range(9):
        model = linear_model() if trial < 6 else random_model(rng)
        counts = 1.0 / np.arange(1, 25) ** rng.uniform(0.5, 1.5)
        counts = counts[rng.permutation(24)]
        sizes = rng.integers(100, 1000, size=24)
        config = PartitionConfig(
            slo_seconds=float(rng.uniform(0.01, 0.06)),
            throughput=float(rng.uniform(50, 400)),
            max_variance=float(rng.uniform(0.01, 0.1)),
            kv_cache_bytes=(None, 40_000, 6_000)[trial % 3],  # 6,000: mu_LLM reaches 0
            tail_mode=mode,
        )
        plan = partition(model, counts, sizes, config)
        expected = _brute_force_smallest(model, counts, sizes, config)
        if expected is None:
            assert not plan.meets_slo and len(plan.cluster_ids) == 24
        else:
            assert plan.meets_slo and len(plan.cluster_ids) == expected, trial
            assert plan.predicted_seconds <= config.target_seconds + 1e-12
        order = hottest_first(counts)
        assert plan.cluster_ids == tuple(int(c) for c in order[: len(plan.cluster_ids)])
        assert plan.num_bytes == int(sizes[list(plan.cluster_ids)].sum())
        assert plan.hit_rate == pytest.approx(counts[list(plan.cluster_ids)].sum() / counts.sum())


@pytest.mark.parametrize("mode", ["batch_mean", "min"])
def test_more_slo_slack_never_yields_more_coverage(mode):
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(25):
        nlist = int(rng.integers(8, 64))
        counts = rng.zipf(rng.uniform(1.2, 2.5), size=nlist).astype(float)
        sizes = rng.integers(1, 100, size=nlist)
        model = (
            random_model(rng)
            if rng.random() < 0.5
            else linear_model(
                cq=(rng.uniform(0, 2e-3), rng.uniform(0, 2e-4)),
                lut=(rng.uniform(1e-3, 2e-2), rng.uniform(1e-4, 5e-3)),
            )
        )
        base = dict(
            throughput=float(rng.uniform(20, 300)),
            max_variance=float(rng.uniform(0.0, 0.2)),
            kv_cache_bytes=None if rng.random() < 0.5 else int(sizes.sum() * rng.uniform(0.5, 4)),
            budget_bytes=None if rng.random() < 0.5 else int(sizes.sum() * rng.uniform(0.2, 1)),
            tail_mode=mode,
        )
        coverages = []
        for slo in np.sort(rng.uniform(0.002, 0.1, size=4)):
            plan = partition(model, counts, sizes, PartitionConfig(slo_seconds=slo, **base))
            coverages.append(plan.coverage)
        assert all(b <= a for a, b in zip(coverages, coverages[1:], strict=False)), coverages
        checked += len(set(coverages)) > 1
    assert checked >= 5  # the SLO actually moved the plan in a good share of the cases


def test_partition_edges_zero_coverage_budget_and_impossible_slo():
    counts = 1.0 / np.arange(1, 33)
    sizes = np.full(32, 10)
    model = linear_model()
    easy = partition(model, counts, sizes, PartitionConfig(10.0, 10.0, 0.05))
    assert easy.cluster_ids == () and easy.meets_slo and easy.coverage == 0.0
    assert easy.tail_hit_rate == 0.0 and easy.predicted_seconds <= easy.target_seconds
    tight = PartitionConfig(0.03, 300.0, 0.05)
    unbounded = partition(model, counts, sizes, tight)
    assert unbounded.meets_slo and 0 < len(unbounded.cluster_ids) < 32
    small = len(unbounded.cluster_ids) - 1
    capped = partition(
        model, counts, sizes, PartitionConfig(0.03, 300.0, 0.05, budget_bytes=small * 10 + 5)
    )
    assert not capped.meets_slo and len(capped.cluster_ids) == small
    assert capped.predicted_seconds > capped.target_seconds
    slow_cq = linear_model(cq=(1.0, 0.0))
    hopeless = partition(slow_cq, counts, sizes, PartitionConfig(0.1, 10.0, 0.05))
    assert not hopeless.meets_slo and len(hopeless.cluster_ids) == 32


def test_kv_coupling_lowers_the_throughput_to_keep_up_with():
    counts = 1.0 / np.arange(1, 33)
    sizes = np.full(32, 10)
    model = linear_model()
    fixed = partition(model, counts, sizes, PartitionConfig(0.03, 300.0, 0.05))
    coupled = partition(
        model, counts, sizes, PartitionConfig(0.03, 300.0, 0.05, kv_cache_bytes=400)
    )
    assert len(coupled.cluster_ids) <= len(fixed.cluster_ids)
    assert coupled.meets_slo


def test_partition_and_config_reject_bad_input():
    counts, sizes = np.ones(4), np.ones(4, dtype=int)
    for kwargs, match in [
        ({"slo_seconds": 0.0}, "slo_seconds"),
        ({"throughput": -1.0}, "throughput"),
        ({"max_variance": 0.3}, "max_variance"),
        ({"queuing_factor": -1.0}, "queuing_factor"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"budget_bytes": -1}, "budget_bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            PartitionConfig(
                **{"slo_seconds": 0.1, "throughput": 1.0, "max_variance": 0.01, **kwargs}
            )
    config = PartitionConfig(0.1, 1.0, 0.01)
    assert config.target_seconds == pytest.approx(0.05)  # Eq. 4 with epsilon = 1
    with pytest.raises(ValueError, match="cluster_bytes shape"):
        partition(linear_model(), counts, np.ones(3), config)
    with pytest.raises(ValueError, match="cluster_bytes"):
        partition(linear_model(), counts, -sizes, config)
    with pytest.raises(ValueError, match="budget_bytes"):
        fill_budget(counts, sizes, -1)


def test_fill_budget_takes_the_hottest_prefix_that_fits():
    counts = np.array([5.0, 50.0, 1.0, 20.0])
    sizes = np.array([10, 30, 10, 20])
    plan = fill_budget(counts, sizes, 55)
    assert plan.cluster_ids == (1, 3) and plan.num_bytes == 50
    assert plan.hit_rate == pytest.approx(70 / 76) and plan.meets_slo is None
    assert fill_budget(counts, sizes, 70).cluster_ids == (1, 3, 0, 2)
    assert fill_budget(counts, sizes, 0).cluster_ids == ()


# -- drift ---------------------------------------------------------------------------------------


def test_drift_in_the_query_distribution_triggers_a_better_plan(calib):
    rng = np.random.default_rng(6)
    probes, nlist = simulate_probes(rng)
    sizes = np.full(nlist, 1000)
    model = linear_model()
    config = PartitionConfig(0.04, 200.0, calib.profile_max_variance(probes, nlist))
    plan = partition(model, count_accesses(probes, nlist), sizes, config)
    assert plan.meets_slo and 0 < len(plan.cluster_ids) < nlist
    detector = DriftDetector(DriftConfig(drop=0.1, min_gain=0.05, patience=3))
    live = None
    perm = rng.permutation(nlist)  # the popular topics move elsewhere
    fired_at = None
    for window in range(10):
        new_probes, _ = simulate_probes(rng, num_queries=1000, perm=perm)
        live = decay_counts(live, count_accesses(new_probes, nlist), 0.5)
        decision = detector.check(plan, live)
        if decision.should_repartition:
            fired_at = window
            break
    assert fired_at is not None and fired_at >= 2  # patience: not on the first bad window
    replan = partition(model, live, sizes, config)
    live_old = live[list(plan.cluster_ids)].sum() / live.sum()
    assert replan.hit_rate > live_old + 0.2
    assert decision.live_hit_rate == pytest.approx(live_old)


def test_drift_detector_does_not_flap_on_a_stable_distribution():
    rng = np.random.default_rng(8)
    probes, nlist = simulate_probes(rng)
    plan = fill_budget(count_accesses(probes, nlist), np.ones(nlist), 40)
    detector = DriftDetector()
    live = None
    for _ in range(30):
        new_probes, _ = simulate_probes(rng, num_queries=500)
        live = decay_counts(live, count_accesses(new_probes, nlist), 0.7)
        assert not detector.check(plan, live).should_repartition


def test_drift_detector_hysteresis_min_accesses_and_plan_reset():
    plan = fill_budget(np.array([10.0, 5.0, 1.0, 1.0]), np.ones(4), 2)  # clusters (0, 1)
    assert plan.hit_rate == pytest.approx(15 / 17)
    detector = DriftDetector(DriftConfig(drop=0.2, min_gain=0.05, patience=2, min_accesses=10))
    drifted = np.array([1.0, 1.0, 10.0, 10.0])
    assert detector.check(plan, drifted / 10).live_hit_rate is None  # too few accesses
    first = detector.check(plan, drifted)
    assert not first.should_repartition and detector.streak == 1
    assert first.best_hit_rate == pytest.approx(20 / 22)
    between = np.array([6.0, 5.0, 2.0, 2.0])  # 11/15 = 0.73: inside the hysteresis band
    assert not detector.check(plan, between).should_repartition and detector.streak == 1
    assert detector.check(plan, drifted).should_repartition and detector.streak == 0
    detector.check(plan, drifted)
    recovered = np.array([10.0, 5.0, 1.0, 1.0])
    detector.check(plan, recovered)
    assert detector.streak == 0
    detector.check(plan, drifted)
    other = fill_budget(np.array([1.0, 1.0, 10.0, 10.0]), np.ones(4), 2)
    detector.check(other, np.array([1.0, 1.0, 10.0, 10.0]))
    assert detector.streak == 0  # a new plan starts a new streak
    with pytest.raises(ValueError, match="live_counts"):
        detector.check(plan, np.ones(3))
    with pytest.raises(ValueError, match="patience"):
        DriftConfig(patience=0)


def test_drift_fires_for_a_better_placement_or_a_broken_premise_then_settles():
    sizes = np.ones(4)
    cold_start = fill_budget(np.zeros(4), sizes, 2)  # no profile yet: clusters (0, 1), rate 0
    assert cold_start.cluster_ids == (0, 1) and cold_start.hit_rate == 0.0
    detector = DriftDetector(DriftConfig(patience=2, min_accesses=10))
    traffic = np.array([1.0, 1.0, 30.0, 30.0])
    assert not detector.check(cold_start, traffic).should_repartition
    assert detector.check(cold_start, traffic).should_repartition  # a better placement exists
    replan = fill_budget(traffic, sizes, 2)
    assert replan.cluster_ids == (2, 3)
    assert not any(detector.check(replan, traffic).should_repartition for _ in range(5))

    peaked = fill_budget(np.array([50.0, 40.0, 5.0, 5.0]), sizes, 2)  # planned for 0.9
    flatter = np.array([30.0, 30.0, 20.0, 20.0])  # same ranking, live rate 0.6
    detector = DriftDetector(DriftConfig(patience=2, min_accesses=10))
    decisions = [detector.check(peaked, flatter) for _ in range(2)]
    assert decisions[0].best_hit_rate == pytest.approx(decisions[0].live_hit_rate)
    assert decisions[1].should_repartition  # Algorithm 1 must re-run with the new counts
    settled = fill_budget(flatter, sizes, 2)
    assert settled.hit_rate == pytest.approx(0.6)
    assert not any(detector.check(settled, flatter).should_repartition for _ in range(5))
