"""``bench/kv_cost_profile.py``: PGDSF's prefill-cost fit (non-negative, rejecting profiles
that price recompute as free or as overhead), its profile on a fake clock, and the host
tier's swap-cost model and profile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ragserve.generation.kv_cache_manager import PrefillCostModel
from ragserve.generation.kv_swap import HostKVCache

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def kv():
    sys.path.insert(0, str(BENCH))
    try:
        import kv_cost_profile
    finally:
        sys.path.remove(str(BENCH))
    return kv_cost_profile


def test_swap_cost_model_and_its_profile(kv):
    SwapCostModel, profile_swap_cost = kv.SwapCostModel, kv.profile_swap_cost

    model = SwapCostModel(per_block_s=0.5, fixed_s=1.0)
    assert model(0) == 0.0 and model(4) == 3.0
    gpu = torch.randn(2, 2, 40, 4, 1, 8)
    host = HostKVCache(gpu, num_host_blocks=40, overlap=True)
    fitted = profile_swap_cost(host, num_gpu_blocks=40)
    assert fitted.per_block_s >= 0.0 and fitted.fixed_s >= 0.0
    assert fitted(32) >= fitted(1) > 0.0
    assert host.num_pending_blocks == 0


def test_prefill_cost_model_fit_and_flops(kv):

    truth = PrefillCostModel(per_token_s=2e-4, per_token_context_s=1e-7, fixed_s=3e-3)
    samples = [(n, c, truth(n, c)) for n in (64, 256) for c in (0, 64, 256)]
    fitted = kv.fit_prefill_cost(samples)
    assert fitted(128, 512) == pytest.approx(truth(128, 512), rel=1e-6)
    with pytest.raises(ValueError, match="samples"):
        kv.fit_prefill_cost(samples[:2])
    flops = PrefillCostModel.from_flops(engine_config_of_tiny())
    assert flops(64, 1024) > flops(64, 0) > 0  # attention over a longer prefix costs more
    assert kv.rejection(fitted, 256) is None


def test_prefill_cost_fit_is_non_negative_and_rejects_broken_profiles(kv):

    # times falling with length: unconstrained least squares gives a negative per-token cost
    falling = [(n, c, 0.6 - 1e-5 * n) for n in (512, 1024, 2048) for c in (0, 512)]
    fitted = kv.fit_prefill_cost(falling)
    assert min(fitted.per_token_s, fitted.per_token_context_s, fitted.fixed_s) >= 0.0
    # the H200 run's profile: the same 0.56 s for every length (recompute priced as free)
    flat = [(n, c, 0.5634596) for n in (512, 1024) for c in (0, 512, 1024)]
    broken = kv.fit_prefill_cost(flat)
    assert broken.per_token_s == 0.0 and broken.fixed_s == pytest.approx(0.5634596)
    assert "per-token cost is 0" in kv.rejection(broken, 1024)
    assert kv.rejection(PrefillCostModel(0.0, 0.0, 0.56), 1024) == "per-token cost is 0"
    # a per-token cost, but the fixed part is most of a 1,024-token prefill: overhead
    overhead = PrefillCostModel(per_token_s=4.7e-6, per_token_context_s=0.0, fixed_s=0.0236)
    assert "fixed cost dominates" in kv.rejection(overhead, 1024)
    assert kv.rejection(PrefillCostModel(1.7e-5, 0.0, 0.0134), 1024) is None


class _FakeEngine:
    """Prefill timings from ``cost(num_tokens, num_cached)`` on a fake clock."""

    def __init__(self, cost):
        from types import SimpleNamespace

        self.cost, self.now, self.cached = cost, 0.0, set()
        self.max_model_len = 4096
        self.model_config = engine_config_of_tiny()
        self.block_manager = SimpleNamespace(reset_prefix_cache=self.cached.clear)
        self.calls = []

    def generate(self, prompts, params):
        (prompt,) = prompts
        hit = max((n for n in range(len(prompt)) if tuple(prompt[:n]) in self.cached), default=0)
        self.now += self.cost(len(prompt) - hit, hit)
        self.cached.update(tuple(prompt[:n]) for n in range(1, len(prompt)))
        self.calls.append(len(prompt))


def test_profile_prefill_cost_warms_up_and_falls_back_when_rejected(kv, caplog):
    PrefillCostModel, profile_prefill_cost = kv.PrefillCostModel, kv.profile_prefill_cost

    truth = PrefillCostModel(per_token_s=2e-5, per_token_context_s=1e-9, fixed_s=2e-3)
    engine = _FakeEngine(truth)
    model = profile_prefill_cost(engine, (64, 128, 256), clock=lambda: engine.now)
    assert engine.calls[:3] == [64, 128, 256]  # the warm-up, untimed
    assert model(200, 300) == pytest.approx(truth(200, 300), rel=1e-6)
    # the broken profile: every prefill takes 0.56 s whatever its length
    engine = _FakeEngine(lambda n, c: 0.56)
    with caplog.at_level("WARNING", logger="kv_cost_profile"):
        model = profile_prefill_cost(engine, (64, 256), clock=lambda: engine.now)
    assert "rejected (per-token cost is 0)" in caplog.text
    assert model.fixed_s == 0.0 and model.per_token_s > 0.0  # recompute is not free
    assert model(256, 0) == pytest.approx(0.56)  # FLOP shape at the measured seconds / FLOP
    assert model(64, 0) < model(256, 0) < model(256, 1024)
    with pytest.raises(ValueError, match="lengths"):
        profile_prefill_cost(engine, (), clock=lambda: engine.now)


def engine_config_of_tiny():
    from ragserve.generation import ModelConfig
    from testing import _ARCHS, _BASE

    return ModelConfig.from_dict({**_BASE, **_ARCHS["llama"]})
