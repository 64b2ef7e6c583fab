"""Per-cluster cost estimates and the measured search profile's piecewise-linear model."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import VectorIndex
from ragserve.retrieval.latency_model import SearchProfile


def test_cluster_costs_are_list_size_times_code_size(small_corpus):
    docs, x = small_corpus
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8, kind="ivf_sq8")
    sizes = vi.cluster_sizes()
    assert sizes.sum() == len(docs) and len(sizes) == 8
    np.testing.assert_array_equal(vi.cluster_cost_bytes(), sizes * 16)  # SQ8: 1 byte per dim


def test_measured_profile_grid_and_round_trip(tmp_path, small_corpus, bench_module):
    measure_profile = bench_module("tier_models").measure_profile
    docs, x = small_corpus
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8)
    prof = measure_profile(vi, x[:8], batch_sizes=(1, 8), repeats=1)
    assert prof.cluster_counts == (1, 4, 8)
    assert len(prof.seconds) == 2 and all(len(r) == 3 and min(r) > 0 for r in prof.seconds)
    assert prof.predict(8, 4) == pytest.approx(prof.seconds[1][1])
    prof.save(tmp_path / "p.json")
    assert SearchProfile.load(tmp_path / "p.json") == prof


def test_predict_is_piecewise_linear_and_extrapolates():
    prof = SearchProfile((1, 10), (1, 3), ((1.0, 3.0), (10.0, 30.0)))
    assert prof.predict(1, 2) == pytest.approx(2.0)
    assert prof.predict(5.5, 1) == pytest.approx(5.5)
    assert prof.predict(10, 5) == pytest.approx(50.0)  # last segment's slope
    assert prof.predict(0, 0) == 0.0  # clamped at zero
