"""Who gets which GPU on the Ray backend (no cluster: a fake ``ray`` records the actor
options): replicas one bundle each, tier holders a share of the same bundles' GPUs, tier
budgets split over the shards; the config refuses a Ray tier without a size."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragserve.retrieval.index_tier import TierSpec
from ragserve.runtime import ServerConfig
from ragserve.runtime.config import GpuTierConfig
from ragserve.runtime.ray_backend import TIER_GPU_SHARE, GpuPlan, RayExecutor, plan_gpus

pytest.importorskip("ray")


def test_plan_gpus_shares_bundles_between_replicas_and_tier_holders() -> None:
    assert plan_gpus(2, 1, True, False, 2) == GpuPlan(2, 1.0, 0.0)
    assert plan_gpus(2, 2, True, True, 2) == GpuPlan(2, 1.0 - TIER_GPU_SHARE, TIER_GPU_SHARE)
    assert plan_gpus(1, 2, True, True, 2) == GpuPlan(2, 1.0 - TIER_GPU_SHARE, TIER_GPU_SHARE)
    assert plan_gpus(2, 1, False, False, 0) == GpuPlan(0, 0.0, 0.0)  # all on CPU
    assert plan_gpus(2, 2, False, True, 2) == GpuPlan(2, 0.0, TIER_GPU_SHARE)
    with pytest.raises(ValueError, match=r"gpu_tier.device: 3 GPU index tier holders .* need 3"):
        plan_gpus(2, 3, True, True, 2)


def test_ray_gpu_tier_needs_an_explicit_budget() -> None:
    with pytest.raises(ValueError, match="gpu_tier.budget_bytes: backend='ray' needs"):
        ServerConfig(backend="ray", gpu_tier=GpuTierConfig(device="cpu"))
    cfg = ServerConfig(backend="ray", gpu_tier=GpuTierConfig(budget_bytes=1 << 20, device="cpu"))
    assert cfg.gpu_tier.budget_bytes == 1 << 20


class _Cls:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.opts = log, name, {}

    def options(self, **opts):
        out = _Cls(self.log, self.name)
        out.opts = opts
        return out

    def remote(self, *args, **kwargs):  # positional args logged; keywords (reranker) not
        self.log.append((self.name, self.opts, args))
        return object()


class _FakeRay:
    def __init__(self) -> None:
        self.log: list = []

    def remote(self, cls):
        return _Cls(self.log, cls.__name__)


@pytest.fixture(autouse=True)
def _no_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import ragserve.runtime.ray_backend as rb

    monkeypatch.setattr(rb, "shard_root", lambda index, m, partition: Path(f"{index}.shards"))


def _started(replicas: int, shards: int, tier: GpuTierConfig | None, gpus: int) -> list:
    config = ServerConfig(
        backend="ray",
        num_llm_replicas=replicas,
        num_index_shards=shards,
        gpu_tier=tier,
        engine_kwargs={"device": "cuda" if gpus else "cpu"},
    )
    ex = RayExecutor.__new__(RayExecutor)
    ex._init_state(config)
    ex._ray = _FakeRay()
    holders_on_gpu = tier is not None and tier.device != "cpu"
    ex._gpu_plan = plan_gpus(replicas, shards, gpus > 0, holders_on_gpu, gpus)
    ex._pg = "pg"
    ex._start_shards("/idx")
    ex._start_coordinator("/idx", None)
    ex._start_replicas("/model")
    return ex._ray.log


def _bundle_of(opts: dict) -> int | None:
    strategy = opts.get("scheduling_strategy")
    return None if strategy is None else strategy.placement_group_bundle_index


def test_two_replicas_two_shards_share_two_gpus_and_split_the_tier() -> None:
    log = _started(2, 2, GpuTierConfig(budget_bytes=1000, device="cuda"), gpus=2)
    shards = [(o, a) for n, o, a in log if n == "ShardServer"]
    assert [_bundle_of(o) for o, _ in shards] == [0, 1]
    assert [o["num_gpus"] for o, _ in shards] == [TIER_GPU_SHARE] * 2
    assert [a[1] for _, a in shards] == [TierSpec(500, "cuda", "float32")] * 2
    coord = [(o, a) for n, o, a in log if n == "RetrievalCoordinator"][0]
    assert "num_gpus" not in coord[0] and coord[1][-1] is None  # the shards hold the tier
    reps = [o for n, o, _ in log if n == "LLMReplica"]
    assert [_bundle_of(o) for o in reps] == [0, 1]
    assert [o["num_gpus"] for o in reps] == [1.0 - TIER_GPU_SHARE] * 2


def test_one_shard_puts_the_tier_in_the_coordinator_beside_replica_zero() -> None:
    log = _started(2, 1, GpuTierConfig(budget_bytes=1000, device="cuda"), gpus=2)
    coord = [(o, a) for n, o, a in log if n == "RetrievalCoordinator"][0]
    assert _bundle_of(coord[0]) == 0 and coord[0]["num_gpus"] == TIER_GPU_SHARE
    assert coord[1][-1] == TierSpec(1000, "cuda", "float32")


def test_cpu_tier_and_cpu_replicas_reserve_no_gpu() -> None:
    log = _started(2, 2, GpuTierConfig(budget_bytes=1000, device="cpu"), gpus=0)
    assert all("num_gpus" not in o for _, o, _ in log)
    shards = [a for n, _, a in log if n == "ShardServer"]
    assert [a[1] for a in shards] == [TierSpec(500, "cpu", "float32")] * 2
