"""HedraRAG Eq. 2: KV-cache vs index-tier split on synthetic profiles with known optima."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval.latency_model import PiecewiseLinear, SearchLatencyModel
from ragserve.retrieval.partition import BetaHitRate
from ragserve.runtime.memory_plan import MemorySplit, ThroughputProfile, solve_memory_split

GB = 1 << 30
BLOCK = 2 << 20  # 2 MiB per KV block


def _brute_force(total, block, gen, ret, min_blocks=1, max_index=None) -> float:
    """Oracle: Eq. 2's objective maximised by scanning every whole-block split."""
    best = -np.inf
    for n in range(min_blocks, total // block + 1):
        tier = total - n * block if max_index is None else min(total - n * block, max_index)
        best = max(best, min(float(gen.at(np.array([n]))[0]), float(ret.at(np.array([tier]))[0])))
    return best


def test_linear_profiles_cross_at_the_analytic_optimum():
    # T_G = 0.02 rps per block, T_R = 2 rps per GB of tier: 0.02 n = 2 (total - n B) / GB
    total = 40 * GB
    gen = ThroughputProfile((0, 20_000), (0.0, 400.0))
    ret = ThroughputProfile((0, 40 * GB), (0.0, 80.0))
    split = solve_memory_split(total, BLOCK, gen, ret)
    n_star = (2 * total / GB) / (0.02 + 2 * BLOCK / GB)
    assert abs(split.num_kv_blocks - n_star) <= 1
    assert split.kv_cache_bytes == split.num_kv_blocks * BLOCK
    assert split.kv_cache_bytes + split.index_tier_bytes == total
    assert split.source == "eq2"
    assert split.predicted_rps == pytest.approx(_brute_force(total, BLOCK, gen, ret))
    assert split.generation_rps == pytest.approx(0.02 * split.num_kv_blocks)


def test_saturated_generation_gives_the_rest_to_the_index_tier():
    # generation stops gaining past 4,000 blocks (8 GB): everything else is worth more as tier
    total = 24 * GB
    gen = ThroughputProfile((0, 4_000, 10_000), (0.0, 50.0, 50.0))
    ret = ThroughputProfile((0, 24 * GB), (1.0, 200.0))
    split = solve_memory_split(total, BLOCK, gen, ret)
    assert split.num_kv_blocks == 4_000
    assert split.index_tier_bytes == total - 4_000 * BLOCK
    assert split.predicted_rps == pytest.approx(50.0)


def test_whole_index_fits_and_the_rest_goes_to_kv():
    total, index_bytes = 40 * GB, 6 * GB
    gen = ThroughputProfile((0, 20_000), (0.0, 400.0))
    ret = ThroughputProfile((0, index_bytes), (1.0, 100.0))  # below T_G all along
    split = solve_memory_split(total, BLOCK, gen, ret, max_index_bytes=index_bytes)
    assert split.index_tier_bytes == index_bytes
    assert split.num_kv_blocks == (total - index_bytes) // BLOCK
    assert split.predicted_rps == pytest.approx(
        _brute_force(total, BLOCK, gen, ret, max_index=index_bytes)
    )


def test_random_profiles_match_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    block = 1 << 20
    for _ in range(20):
        total = int(rng.integers(64, 512)) * block + int(rng.integers(0, block))
        gen_sizes = np.sort(rng.choice(np.arange(1, 600), size=5, replace=False))
        ret_sizes = np.sort(rng.choice(np.arange(1, 600), size=5, replace=False)) * block
        gen = ThroughputProfile(tuple(gen_sizes), tuple(np.sort(rng.uniform(0, 100, 5))))
        ret = ThroughputProfile(tuple(ret_sizes), tuple(np.sort(rng.uniform(0, 100, 5))))
        min_blocks = int(rng.integers(0, 16))
        split = solve_memory_split(total, block, gen, ret, min_kv_blocks=min_blocks)
        assert split.num_kv_blocks >= min_blocks
        assert split.kv_cache_bytes + split.index_tier_bytes <= total
        assert split.predicted_rps == pytest.approx(
            _brute_force(total, block, gen, ret, min_blocks=min_blocks)
        )


def test_explicit_overrides():
    total = 10 * GB
    gen = ThroughputProfile((0, 5_000), (0.0, 100.0))
    ret = ThroughputProfile((0, 10 * GB), (0.0, 100.0))
    kv = solve_memory_split(total, BLOCK, None, None, kv_cache_bytes=3 * GB + 123)
    assert kv == MemorySplit(3 * GB, 7 * GB, 3 * GB // BLOCK, "override")
    assert kv.predicted_rps is None
    tier = solve_memory_split(total, BLOCK, gen, ret, index_tier_bytes=4 * GB + 5)
    assert tier.index_tier_bytes == 4 * GB + 5
    assert tier.kv_cache_bytes == (6 * GB - 5) // BLOCK * BLOCK
    assert tier.source == "override" and tier.retrieval_rps == pytest.approx(40.0, rel=1e-6)
    both = solve_memory_split(total, BLOCK, None, None, kv_cache_bytes=GB, index_tier_bytes=GB)
    assert (both.kv_cache_bytes, both.index_tier_bytes) == (GB, GB)
    capped = solve_memory_split(total, BLOCK, None, None, kv_cache_bytes=GB, max_index_bytes=GB)
    assert capped.index_tier_bytes == GB


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_bytes": 6 * GB, "index_tier_bytes": 5 * GB}, "total_bytes"),
        ({"index_tier_bytes": 11 * GB}, "index_tier_bytes"),
        ({"kv_cache_bytes": -1}, "kv_cache_bytes"),
        ({"kv_cache_bytes": BLOCK - 1}, "min_kv_blocks"),
        ({"min_kv_blocks": 10_000}, "min_kv_blocks"),
        ({"max_index_bytes": -1}, "max_index_bytes"),
        ({}, "profiles are required"),
    ],
)
def test_infeasible_inputs_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_memory_split(10 * GB, BLOCK, None, None, **kwargs)
    with pytest.raises(ValueError, match="block_bytes"):
        solve_memory_split(10 * GB, 0, None, None, kv_cache_bytes=GB)


def test_throughput_profiles_validate_and_convert_latency():
    with pytest.raises(ValueError, match="ascending"):
        ThroughputProfile((2, 1), (1.0, 2.0))
    with pytest.raises(ValueError, match="equal length"):
        ThroughputProfile((1, 2), (1.0,))
    with pytest.raises(ValueError, match="requests_per_second"):
        ThroughputProfile((1, 2), (1.0, -2.0))
    prof = ThroughputProfile.from_batch_latency((0, GB), (0.5, 0.1), 32, retrievals_per_request=2)
    assert prof.requests_per_second == pytest.approx((32.0, 160.0))
    np.testing.assert_allclose(prof.at(np.array([-1, GB // 2, 2 * GB])), [32.0, 96.0, 160.0])
    with pytest.raises(ValueError, match="batch_seconds"):
        ThroughputProfile.from_batch_latency((0, GB), (0.0, 0.1), 32)
    with pytest.raises(ValueError, match="batch_size"):
        ThroughputProfile.from_batch_latency((0, GB), (0.5, 0.1), 0)


@pytest.mark.parametrize("mode", ["batch_mean", "min"])
def test_modelled_retrieval_profile_feeds_eq2(mode, bench_module):
    modelled_retrieval_profile = bench_module("eq2_model").modelled_retrieval_profile
    model = SearchLatencyModel(
        64,
        PiecewiseLinear((1.0, 64.0), (0.002, 0.010)),
        PiecewiseLinear((1.0, 64.0), (0.020, 0.500)),
    )
    counts = 1.0 / np.arange(1, 129)  # cluster i is the (i+1)-th hottest
    cluster_bytes = np.full(128, GB // 8)
    prof = modelled_retrieval_profile(
        model, counts, cluster_bytes, 0.05, [0, 4 * GB, 16 * GB], batch_size=32, tail_mode=mode
    )
    assert prof.sizes == (0, 4 * GB, 16 * GB)
    assert prof.requests_per_second[0] == pytest.approx(32 / model.cpu_seconds(32))
    assert prof.requests_per_second[2] == pytest.approx(32 / model.cq_seconds(32))  # all on GPU
    share = counts[:32].sum() / counts.sum()
    tail = BetaHitRate.from_mean(share, 0.05).tail(32, mode)
    assert prof.requests_per_second[1] == pytest.approx(32 / model.hybrid_seconds(32, tail))
    assert np.all(np.diff(prof.requests_per_second) > 0)
    gen = ThroughputProfile((0, 20_000), (0.0, 400.0))
    split = solve_memory_split(40 * GB, BLOCK, gen, prof, max_index_bytes=16 * GB)
    assert split.predicted_rps == pytest.approx(
        _brute_force(40 * GB, BLOCK, gen, prof, max_index=16 * GB)
    )
    with pytest.raises(ValueError, match="tier_sizes"):
        modelled_retrieval_profile(model, counts, cluster_bytes, 0.05, [], batch_size=32)
