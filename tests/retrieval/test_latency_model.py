"""VectorLiteRAG's latency model: piecewise-linear fits, Eq. 1 and its inverse, profiling."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import VectorIndex
from ragserve.retrieval.latency_model import (
    PiecewiseLinear,
    SearchLatencyModel,
    SearchProfile,
    fit_piecewise_linear,
)


def test_piecewise_linear_interpolates_and_extends_end_segments():
    f = PiecewiseLinear((1.0, 3.0, 5.0), (1.0, 5.0, 6.0))
    assert f.slopes == (2.0, 0.5)
    assert f(2.0) == pytest.approx(3.0)
    assert f(0.0) == pytest.approx(-1.0)  # first segment extended
    assert f(9.0) == pytest.approx(8.0)  # last segment extended
    np.testing.assert_allclose(f.evaluate(np.array([[1.0, 4.0]])), [[1.0, 5.5]])
    assert PiecewiseLinear((2.0,), (7.0,))(100.0) == 7.0


@pytest.mark.parametrize(
    "knots, values",
    [((), ()), ((1.0, 2.0), (1.0,)), ((2.0, 1.0), (0.0, 0.0)), ((1.0, np.inf), (0.0, 0.0))],
)
def test_piecewise_linear_rejects_bad_knots(knots, values):
    with pytest.raises(ValueError, match="knots"):
        PiecewiseLinear(knots, values)


def test_fit_recovers_known_segments_exactly_without_noise():
    truth = PiecewiseLinear((1.0, 8.0, 32.0, 128.0), (0.002, 0.004, 0.028, 0.060))
    x = np.array([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128], dtype=float)
    fit = fit_piecewise_linear(x, truth.evaluate(x))
    assert fit.knots == truth.knots
    np.testing.assert_allclose(fit.values, truth.values, rtol=1e-9, atol=1e-12)


def test_fit_recovers_known_segments_with_noise():
    rng = np.random.default_rng(7)
    truth = PiecewiseLinear((1.0, 16.0, 64.0), (1.0, 4.0, 28.0))
    x = np.repeat(np.arange(1.0, 65.0, 3.0), 3)
    y = truth.evaluate(x) * (1.0 + 0.01 * rng.normal(size=x.size))
    fit = fit_piecewise_linear(x, y)
    assert len(fit.knots) == 3
    assert abs(fit.knots[1] - 16.0) <= 3.0
    np.testing.assert_allclose(fit.slopes, truth.slopes, rtol=0.1)


def test_fit_with_fixed_segment_count_and_single_segment():
    x = np.arange(1.0, 11.0)
    line = fit_piecewise_linear(x, 3.0 * x + 1.0, num_segments=1)
    assert line.knots == (1.0, 10.0) and line.slopes == pytest.approx((3.0,))
    kink = fit_piecewise_linear(x, np.maximum(x, 5.0), num_segments=2)
    assert kink.knots == (1.0, 5.0, 10.0)
    np.testing.assert_allclose(kink.values, (5.0, 5.0, 10.0), atol=1e-9)


@pytest.mark.parametrize(
    "x, y, kwargs, match",
    [
        ([1.0, 1.0], [1.0, 2.0], {}, "distinct"),
        ([1.0, 2.0], [1.0], {}, "equal length"),
        ([1.0, 2.0], [1.0, np.nan], {}, "finite"),
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], {"num_segments": 3}, "num_segments=3"),
        ([1.0, 2.0], [1.0, 2.0], {"num_segments": 0}, "num_segments"),
        ([1.0, 2.0], [1.0, 2.0], {"max_segments": 0}, "max_segments"),
    ],
)
def test_fit_rejects_bad_input(x, y, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_piecewise_linear(x, y, **kwargs)


def _model() -> SearchLatencyModel:
    cq = PiecewiseLinear((1.0, 64.0), (0.001, 0.008))
    lut = PiecewiseLinear((1.0, 4.0, 64.0), (0.010, 0.016, 0.136))
    return SearchLatencyModel(256, cq, lut)


def test_eq1_hybrid_latency_and_its_inverse():
    m = _model()
    assert m.cpu_seconds(4) == pytest.approx(m.cq_seconds(4) + 0.016)
    assert m.hybrid_seconds(4, 0.0) == pytest.approx(m.cpu_seconds(4))
    assert m.hybrid_seconds(4, 1.0) == pytest.approx(m.cq_seconds(4))
    assert m.hybrid_seconds(4, 0.25) == pytest.approx(m.cq_seconds(4) + 0.75 * 0.016)
    for b, budget in [(1, 0.006), (4, 0.010), (64, 0.05)]:
        eta = m.required_hit_rate(b, budget)
        assert eta is not None and 0.0 < eta < 1.0
        assert m.hybrid_seconds(b, eta) == pytest.approx(budget)
    assert m.required_hit_rate(4, 1.0) == 0.0  # the CPU alone is fast enough
    assert m.required_hit_rate(64, 0.005) is None  # coarse quantization alone is too slow
    with pytest.raises(ValueError, match="tail_hit_rate"):
        m.hybrid_seconds(4, 1.5)


def test_predictions_are_a_non_decreasing_envelope():
    # a fitted dip (single-thread -> multi-thread) must not predict a faster larger batch
    lut = PiecewiseLinear((1.0, 2.0, 8.0, 32.0), (0.004, 0.010, 0.006, 0.030))
    m = SearchLatencyModel(8, PiecewiseLinear((1.0,), (0.0,)), lut)
    b = np.arange(1, 40, dtype=float)
    got = m.lut_array(b)
    assert np.all(np.diff(got) >= 0)
    assert got[1] == pytest.approx(0.010) and got[4] == pytest.approx(0.010)
    assert m.lut_seconds(32) == pytest.approx(0.030)
    clamp = SearchLatencyModel(8, PiecewiseLinear((1.0, 2.0), (-1.0, -0.5)), lut)
    assert clamp.cq_seconds(1) == 0.0


def test_from_profile_reads_lut_at_nprobe(bench_module):
    from_profile = bench_module("tier_models").model_from_profile
    prof = SearchProfile((1, 8, 32), (4, 16), ((1.0, 4.0), (2.0, 8.0), (5.0, 20.0)))
    m = from_profile(prof, 16, (0.1, 0.2, 0.5))
    assert m.lut_seconds(8) == pytest.approx(8.0)
    assert m.cq_seconds(32) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cq_seconds"):
        from_profile(prof, 16, (0.1,))
    with pytest.raises(ValueError, match="nprobe"):
        SearchLatencyModel(0, m.cq, m.lut)
    with pytest.raises(ValueError, match="lut_seconds"):
        SearchLatencyModel.fit(4, (1, 2), (0.1, 0.2), (-1.0, 0.2))


def test_measure_cpu_model_times_assign_and_scan(small_corpus, bench_module):
    measure_cpu_model = bench_module("tier_models").measure_cpu_model
    docs, x = small_corpus
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8)
    m = measure_cpu_model(vi, x[:8], 4, batch_sizes=(1, 2, 4, 8), repeats=1)
    assert m.nprobe == 4 and m.cq.knots[0] == 1.0 and m.lut.knots[-1] == 8.0
    assert m.cpu_seconds(8) > 0
    with pytest.raises(ValueError, match="need 16 queries"):
        measure_cpu_model(vi, x[:8], 4, batch_sizes=(1, 16))
    with pytest.raises(ValueError, match="repeats"):
        measure_cpu_model(vi, x[:8], 4, batch_sizes=(1, 2), repeats=0)


def test_measure_scan_grid_calls_every_point_and_synchronizes(bench_module):
    measure_scan_grid = bench_module("tier_models").measure_scan_grid
    calls: list[tuple[int, int]] = []
    syncs = []
    prof = measure_scan_grid(
        lambda b, c: calls.append((b, c)),
        (1, 4),
        (2, 8, 16),
        repeats=2,
        warmup=1,
        synchronize=lambda: syncs.append(1),
    )
    assert prof.batch_sizes == (1, 4) and prof.cluster_counts == (2, 8, 16)
    assert len(prof.seconds) == 2 and all(len(r) == 3 for r in prof.seconds)
    assert len(calls) == 6 * 3 and calls.count((4, 16)) == 3
    assert len(syncs) == 6 * 3  # once after warm-up, once per timed call
    with pytest.raises(ValueError, match="ascending"):
        measure_scan_grid(lambda b, c: None, (4, 1), (2,))
    with pytest.raises(ValueError, match=">= 1"):
        measure_scan_grid(lambda b, c: None, (0, 1), (2,))


def test_model_round_trips_through_json(tmp_path):
    m = _model()
    m.save(tmp_path / "model.json")
    assert SearchLatencyModel.load(tmp_path / "model.json") == m
    with pytest.raises(ValueError, match="SearchLatencyModel"):
        SearchLatencyModel.from_json('{"nprobe": 4}')
