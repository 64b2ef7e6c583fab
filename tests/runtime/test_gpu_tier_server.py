"""The GPU index tier through the runtime: ServerConfig.gpu_tier, the Eq. 2 memory plan and the
`ragserve serve` flags (tier on CPU tensors here)."""

from __future__ import annotations

import argparse
import json

import pytest

from ragserve.runtime import CoScheduleConfig, GpuTierConfig, Server, ServerConfig
from ragserve.runtime.memory_plan import load_profiles, plan_gpu_memory
from ragserve.workflows import get_workflow

SHORT = get_workflow("oneshot", max_tokens=6)  # the built-in, with a short answer

ENGINE = {"device": "cpu", "enable_prefix_caching": False}


def test_in_process_server_serves_through_the_tier(local_server, tiny_model, small_index) -> None:
    config = ServerConfig(
        in_process=True,
        engine_kwargs=ENGINE,
        gpu_tier=GpuTierConfig(budget_bytes=1 << 26, device="cpu"),
    )
    with Server(tiny_model, small_index, config=config) as s:
        tier = s.executor.retrieval.index.gpu_tier
        assert tier is not None and tier.device == "cpu" and len(tier.clusters) == 4
        for q in ("What is the capital of Kenya?", "Which countries are in Europe?"):
            with_tier = s.run(q, SHORT)
            plain = local_server.run(q, SHORT)
            assert with_tier.error is None
            assert with_tier.doc_ids == plain.doc_ids
        assert tier.hit_rate == 1.0
        assert s.stats()["cosched"] == [] and not s.cosched.auto  # auto: the tier holds it all


def test_worker_process_builds_the_tier(tiny_model, small_index) -> None:
    config = ServerConfig(
        engine_kwargs=ENGINE, gpu_tier=GpuTierConfig(budget_bytes=1 << 26, device="cpu")
    )
    with Server(tiny_model, small_index, config=config) as s:
        assert s.stats()["cosched"] == []  # resolved through the worker's gpu_tier_stats
        r = s.run("What is the capital of Peru?", SHORT)
        assert r.error is None and r.doc_ids


def test_cosched_auto_follows_the_tier(tiny_model, small_index) -> None:
    """``auto`` keeps every transform unless the tier holds every non-empty list; ``all``
    (``auto=False``) keeps them whatever the tier; switching the tier re-resolves."""
    everything = ["split", "gen_chunks", "similarity", "speculation"]
    one_list = GpuTierConfig(budget_bytes=400_000, device="cpu")  # one 256-row chunk at dim 384
    config = ServerConfig(in_process=True, engine_kwargs=ENGINE, gpu_tier=one_list)
    with Server(tiny_model, small_index, config=config) as s:
        assert len(s.executor.retrieval.index.gpu_tier.clusters) == 1
        assert s.stats()["cosched"] == everything
        assert s.executor.call_retrieval("gpu_tier_stats").result()["holds_index"] is False
        s.executor.call_retrieval("set_gpu_tier", 1 << 26, "cpu").result()
        s.set_cosched(config.cosched)
        assert s.stats()["cosched"] == []
        s.set_cosched(CoScheduleConfig.from_names("all"))
        assert s.stats()["cosched"] == everything
        assert s.run("What is the capital of Kenya?", SHORT).error is None
    forced = ServerConfig(
        in_process=True,
        engine_kwargs=ENGINE,
        gpu_tier=GpuTierConfig(budget_bytes=1 << 26, device="cpu"),
        cosched=CoScheduleConfig(enable_speculation=False, auto=False),
    )
    with Server(tiny_model, small_index, config=forced) as s:
        assert s.stats()["cosched"] == ["split", "gen_chunks", "similarity"]
    resolved = CoScheduleConfig().resolve(True)
    assert resolved.enabled == () and resolved.cache_topk == CoScheduleConfig().cache_topk
    assert CoScheduleConfig(enable_split=False).resolve(False).enabled == (
        "similarity",
        "speculation",
    )
    assert CoScheduleConfig.from_names("auto").auto and not CoScheduleConfig.from_names("all").auto
    assert not CoScheduleConfig.from_names("split", auto=True).auto  # a list is exact


def test_eq2_sets_the_kv_cache_and_the_tier(tiny_model, small_index) -> None:
    gen = ((16, 1.0), (64, 4.0), (256, 8.0))
    ret = ((0, 2.0), (1 << 20, 6.0), (1 << 22, 9.0))
    tier = GpuTierConfig(
        device="cpu", gpu_memory_bytes=1 << 23, generation_profile=gen, retrieval_profile=ret
    )
    resolved, plan = plan_gpu_memory(
        ServerConfig(engine_kwargs=ENGINE, gpu_tier=tier), tiny_model, small_index
    )
    kv = dict(resolved.engine_kwargs)["kv_cache_bytes"]
    assert plan.source == "eq2" and plan.kv_cache_bytes == kv
    assert kv + plan.tier_bytes <= 1 << 23 and plan.tier_bytes > 0


def test_overrides_and_missing_profiles(tiny_model, small_index) -> None:
    off, plan = plan_gpu_memory(ServerConfig(engine_kwargs=ENGINE), tiny_model, small_index)
    assert (
        plan.tier_bytes is None
        and off.engine_kwargs == ServerConfig(engine_kwargs=ENGINE).engine_kwargs
    )
    fixed = GpuTierConfig(budget_bytes=1 << 20, device="cpu")
    _, plan = plan_gpu_memory(ServerConfig(gpu_tier=fixed), tiny_model, small_index)
    assert (plan.tier_bytes, plan.source) == (1 << 20, "override")
    both = GpuTierConfig(budget_bytes=1 << 22, device="cpu", gpu_memory_bytes=1 << 23)
    fits = ServerConfig(engine_kwargs={**ENGINE, "kv_cache_bytes": 1 << 22}, gpu_tier=both)
    assert plan_gpu_memory(fits, tiny_model, small_index)[1].source == "override"
    over = ServerConfig(engine_kwargs={**ENGINE, "kv_cache_bytes": 5 << 20}, gpu_tier=both)
    with pytest.raises(ValueError, match=r"budget_bytes \(0.00 GB\) \+ kv_cache_bytes .* exceed"):
        plan_gpu_memory(over, tiny_model, small_index)
    bare = GpuTierConfig(device="cpu", gpu_memory_bytes=1 << 23)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_gpu_memory(ServerConfig(gpu_tier=bare), tiny_model, small_index)
    with pytest.raises(ValueError, match="dtype"):
        GpuTierConfig(dtype="int8")
    with pytest.raises(ValueError, match="budget_bytes"):
        GpuTierConfig(budget_bytes=-1)


def test_serve_flags(tmp_path) -> None:
    from ragserve.cli.serve import gpu_tier_config

    def args(**kw):
        base = {
            "gpu_index_gb": None,
            "gpu_index_profile": None,
            "gpu_index_device": "cuda",
            "gpu_index_dtype": "float32",
            "gpu_index_scan": "auto",
            "gpu_index_stream": "auto",
            "gpu_index_stream_host_gb": None,
        }
        return argparse.Namespace(**{**base, **kw})

    assert gpu_tier_config(args()) is None
    assert gpu_tier_config(args(gpu_index_gb=1.5)).budget_bytes == 1_500_000_000
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"generation_profile": [[1, 2.0]], "retrieval_profile": [[0, 1.0]]}))
    cfg = gpu_tier_config(args(gpu_index_profile=str(path), gpu_index_dtype="float16"))
    assert cfg.budget_bytes is None and cfg.dtype == "float16"
    assert cfg.generation_profile == ((1.0, 2.0),)
    path.write_text("{}")
    with pytest.raises(ValueError, match="generation_profile"):
        load_profiles(path)
    with pytest.raises(ValueError, match="gpu-index-gb"):
        gpu_tier_config(args(gpu_index_gb=-1.0))
    cfg = gpu_tier_config(
        args(
            gpu_index_gb=1.0,
            gpu_index_scan="dense",
            gpu_index_stream="on",
            gpu_index_stream_host_gb=0.5,
        )
    )
    assert (cfg.scan, cfg.stream_cold, cfg.stream_host_bytes) == ("dense", "on", 500_000_000)
    assert gpu_tier_config(args(gpu_index_gb=1.0)).stream_cold == "auto"
    with pytest.raises(ValueError, match="gpu-index-stream-host-gb"):
        gpu_tier_config(args(gpu_index_gb=1.0, gpu_index_stream_host_gb=0.0))


def test_scan_and_stream_reach_the_tier(tiny_model, small_index) -> None:
    """``GpuTierConfig.scan``/``stream_cold`` pass through the runtime to the placed tier."""
    tier_config = GpuTierConfig(
        budget_bytes=1 << 26,
        device="cpu",
        scan="dense",
        stream_cold="on",
        stream_host_bytes=1 << 20,
    )
    config = ServerConfig(in_process=True, engine_kwargs=ENGINE, gpu_tier=tier_config)
    with Server(tiny_model, small_index, config=config) as s:
        tier = s.executor.retrieval.index.gpu_tier
        assert tier.scan_strategy == "dense"
        assert tier.streamer is not None and tier.streamer.config.host_budget_bytes == 1 << 20
        assert s.run("What is the capital of Kenya?", SHORT).error is None
    from ragserve.retrieval.cold_stream import STREAM_MODES
    from ragserve.retrieval.gpu_tier import SCANS
    from ragserve.runtime import config as runtime_config

    assert runtime_config.TIER_SCANS == SCANS  # the runtime's copies (no torch import there)
    assert runtime_config.STREAM_MODES == STREAM_MODES
    spec = tier_config.tier_spec(123)
    assert spec.budget_bytes == 123 and spec.stream_config().mode == "on"
    for bad, match in (
        ({"scan": "triton"}, "scan must be one of"),
        ({"stream_cold": "yes"}, "stream_cold must be one of"),
        ({"stream_host_bytes": 0}, "stream_host_bytes"),
    ):
        with pytest.raises(ValueError, match=match):
            GpuTierConfig(**bad)
