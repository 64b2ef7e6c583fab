"""``bench/bench_kv_reuse.py``: the H200 preset's settings are valid engine settings (fast, no
model), and its CPU twin runs every configuration end to end at a tiny scale, survives a
failing configuration and keeps to its time budget."""

from __future__ import annotations

import json

import pytest

from ragserve.generation import EngineConfig, ModelConfig


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("bench_kv_reuse")


@pytest.mark.parametrize("preset", ["h200-llama8b", "h200-llama8b-tiers"])
def test_h200_preset_is_a_valid_run(bench, tmp_path, preset) -> None:
    a = bench.parse_args(["--preset", preset])
    assert a.dummy and a.device == "cuda" and a.dtype == "bfloat16"
    model = bench.dummy_folder(tmp_path / "model", bench.DUMMY_MODELS[a.model])
    cfg = ModelConfig.from_folder(model)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (32, 4096, 8)
    per_token = bench.kv_bytes_per_token(str(model), a)
    assert per_token == 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16
    workload = bench.make_workload(a)
    assert len(workload) == a.num_requests
    prompt_len = 48 + a.topk * a.passage_tokens + a.question_tokens
    assert all(len(ids) == prompt_len and ends[-1] == prompt_len for ids, ends, _ in workload)
    assert bench.max_model_len(a) <= cfg.max_position_embeddings
    # the GPU pool holds several prompts but far fewer than the distinct ones: the host matters
    distinct = {tuple(ids[: prompt_len - a.question_tokens]) for ids, _, _ in workload}
    assert 4 * bench.max_model_len(a) <= a.gpu_kv_tokens < len(distinct) * prompt_len
    assert a.time_budget and a.time_budget <= 480
    for name, config in bench.CONFIGS.items():
        kw = bench.engine_kwargs(a, config, per_token)
        EngineConfig(model=str(model), **kw)  # every keyword exists and is valid
        assert (kw["host_kv_cache_bytes"] > 0) == ("host" in name)


@pytest.mark.parametrize("preset", ["h200-llama8b-tiers", "cpu-tiny-tiers"])
def test_tiers_presets_working_set_between_gpu_and_gpu_plus_host(bench, preset) -> None:
    a = bench.parse_args(["--preset", preset])
    working_set = bench.working_set_tokens(a, bench.make_workload(a))
    # a GPU-only cache thrashes (>= 2.5x its pool), the host tier alone holds it all
    assert 2.5 * a.gpu_kv_tokens <= working_set <= a.host_kv_tokens
    prefix = 48 + a.topk * a.passage_tokens
    assert working_set <= a.topics * prefix  # topics share at least the instruction
    assert working_set > 0.8 * a.topics * (prefix - 48)  # but few whole passage paths


def test_working_set_counts_distinct_blocks(bench) -> None:
    a = bench.parse_args(["--preset", "cpu-tiny", "--topics", "1", "--passage-tokens", "32"])
    # one topic: the instruction (48 tokens) and 5 passages of 32, 16-token blocks: 13 blocks
    assert bench.working_set_tokens(a, bench.make_workload(a)) == (48 + 5 * 32) // 16 * 16


def test_unknown_config_is_refused_before_any_work(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "cpu-tiny", "--configs", "no_reuse,tree_gpu_lfu"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "cpu-tiny", "--capacity-configs", "no_reuse,lfu"])


@pytest.mark.slow  # eight engines one after the other; the smoke run below covers the path
def test_cpu_twin_runs_every_config(bench, tmp_path) -> None:
    out = tmp_path / "kv.json"
    argv = ["--preset", "cpu-tiny", "--num-requests", "3", "--out", str(out),
            "--configs", ",".join(bench.CONFIGS)]  # fmt: skip
    results = bench.main(argv)
    assert json.loads(out.read_text())["configs"].keys() == bench.CONFIGS.keys()
    for name, row in results["configs"].items():
        assert "error" not in row and "skipped" not in row, (name, row)
        # CPU float32: every configuration's tokens equal no reuse's, in both replays
        assert row["identical"] is True and row["agreement"] == 1.0, name
        assert row["ttft_speedup_vs_no_reuse"] > 0
    assert results["configs"]["no_reuse"]["stats"]["prefix_cache_hit_tokens"] == 0
    hits = results["configs"]["tree_host_pgdsf"]["stats"]["prefix_cache_hit_tokens"]
    assert hits > 0  # topics repeat: the tree reuses passages


SUSTAINED = ["--window-requests", "12", "--ttft-requests", "6", "--warmup-s", "0.1",
             "--drain-s", "1", "--slo", "5", "--load", "0.5", "--max-probes", "2"]  # fmt: skip


@pytest.mark.slow  # benchmark-shaped: real sustained-load probes or replays
def test_sustained_passes_use_a_common_rate_and_the_control_replay(bench) -> None:
    argv = ["--preset", "cpu-tiny", "--num-requests", "4", "--configs", "no_reuse,block_cache",
            "--control", *SUSTAINED]  # fmt: skip
    rows = bench.main(argv)["configs"]
    base = rows["no_reuse"]
    # the common rate: 0.5 x the first configuration's all-at-once throughput
    assert base["rate_rps"] == pytest.approx(0.5 * base["replay"]["requests_per_s"])
    assert base["warm_replay"] is None  # no cache: the cold replay is the steady state
    assert base["control"]["agreement"] == 1.0  # float32 on CPU: order changes no token
    assert "control" not in rows["block_cache"]
    for row in rows.values():
        assert row["paced"]["rate"] == base["rate_rps"] and row["paced"]["window_requests"] == 6
        assert row["mean_ttft_s"] == row["paced"]["mean_ttft_s"]
        assert row["identical"] is True
        cap = row["capacity"]
        assert 1 <= len(cap["points"]) <= 2 and cap["bound"] in ("=", "~", ">=", "<")
        assert all(p["window_requests"] == 12 for p in cap["points"])
        sustained = [p["rate"] for p in cap["points"] if p["sustained"]]
        assert row["throughput_rps"] == (max(sustained) if sustained else None)
        assert cap["points"][0]["rate"] == pytest.approx(
            0.9 * (row["warm_replay"] or row["replay"])["requests_per_s"]
        )


@pytest.mark.slow  # benchmark-shaped: real sustained-load probes or replays
def test_capacity_searched_only_where_asked(bench) -> None:
    argv = ["--preset", "cpu-tiny", "--num-requests", "4", "--configs",
            "no_reuse,block_cache,tree_gpu_lru", "--capacity-configs", "block_cache",
            *SUSTAINED]  # fmt: skip
    rows = bench.main(argv)["configs"]
    assert [name for name, row in rows.items() if "capacity" in row] == ["block_cache"]
    skipped = rows["tree_gpu_lru"]
    assert skipped["throughput_rps"] is None and "throughput_ratio_vs_no_reuse" not in skipped
    assert skipped["paced"]["rate"] == rows["no_reuse"]["rate_rps"]
    assert skipped["mean_ttft_s"] == skipped["paced"]["mean_ttft_s"]


@pytest.mark.slow  # benchmark-shaped: real sustained-load probes or replays
def test_reserve_keeps_probes_for_later_configurations(bench) -> None:
    # a 1000-s reserve per later configuration leaves the first none: its search stops
    argv = ["--preset", "cpu-tiny", "--num-requests", "4", "--configs", "no_reuse,block_cache",
            "--time-budget", "600", "--reserve-s", "1000", *SUSTAINED]  # fmt: skip
    rows = bench.main(argv)["configs"]
    first = rows["no_reuse"]["capacity"]
    assert first["points"] == [] and first["stopped"].startswith("time budget")
    assert rows["no_reuse"]["mean_ttft_s"] is not None  # the TTFT probe still ran
    assert len(rows["block_cache"]["capacity"]["points"]) >= 1  # the last one has no reserve


@pytest.mark.slow  # benchmark-shaped: real sustained-load probes or replays
def test_cpu_tiers_twin_host_tier_serves_hits_and_beats_the_block_cache(bench) -> None:
    argv = ["--preset", "cpu-tiny-tiers", "--num-requests", "32", "--max-tokens", "2",
            "--configs", "no_reuse,block_cache,tree_gpu_pgdsf,tree_host_pgdsf"]  # fmt: skip
    rows = bench.main(argv)["configs"]
    host, block = rows["tree_host_pgdsf"], rows["block_cache"]
    assert all(row["identical"] for row in rows.values())
    assert host["stats"]["num_host_hit_tokens"] > 0
    assert host["stats"]["num_swapped_in_blocks"] > 0
    # warm replay: the host tier keeps the working set; the GPU-only caches thrash
    assert rows["no_reuse"]["prefill_tokens"] == rows["no_reuse"]["warm_replay"]["prompt_tokens"]
    assert host["prefill_reduction_vs_block_cache"] >= 2.0
    assert host["prefill_tokens"] * 2 <= block["prefill_tokens"]
    assert rows["tree_gpu_pgdsf"]["prefill_tokens"] > 2 * host["prefill_tokens"]


def test_smoke_a_failing_config_is_recorded_and_the_run_goes_on(
    bench, monkeypatch, tmp_path
) -> None:
    """The default tier's run of the script: replays of the host tier's configuration after a
    configuration that fails to build, the JSON written."""
    real = bench.build_engine

    def build(model, a, config):
        if config is bench.CONFIGS["block_cache"]:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(model, a, config)

    monkeypatch.setattr(bench, "build_engine", build)
    out = tmp_path / "kv.json"
    argv = ["--preset", "cpu-tiny", "--num-requests", "3", "--max-tokens", "2", "--load", "0",
            "--out", str(out), "--configs", "no_reuse,block_cache,tree_host_pgdsf"]  # fmt: skip
    rows = bench.main(argv)["configs"]
    assert rows["block_cache"]["error"] == "RuntimeError: CUDA out of memory (simulated)"
    assert json.loads(out.read_text())["configs"]["block_cache"]["error"]
    for name in ("no_reuse", "tree_host_pgdsf"):
        assert rows[name]["identical"] is True and rows[name]["agreement"] == 1.0, name
    assert rows["tree_host_pgdsf"]["ttft_speedup_vs_no_reuse"] > 0
    assert rows["no_reuse"]["stats"]["prefix_cache_hit_tokens"] == 0
    assert rows["tree_host_pgdsf"]["stats"]["prefix_cache_hit_tokens"] > 0  # topics repeat


def test_time_budget_skips_what_would_start_too_late(bench) -> None:
    argv = ["--preset", "cpu-tiny", "--time-budget", "1e-9", "--configs", "no_reuse,block_cache"]
    rows = bench.main(argv)["configs"]
    assert rows == {
        "no_reuse": {"skipped": "time budget spent"},
        "block_cache": {"skipped": "time budget spent"},
    }


def test_a_sustained_pass_cut_by_the_budget_keeps_the_replays(
    bench, bench_module, monkeypatch
) -> None:
    def cut(*a, **kw):
        raise bench.PassTimeout("stopped at the time budget after 0 requests")

    monkeypatch.setattr(bench_module("kv_reuse_passes"), "search_capacity", cut)
    # a short TTFT probe (2 counted arrivals, offered above capacity: it ends when they do)
    argv = ["--preset", "cpu-tiny", "--num-requests", "2", "--max-tokens", "2", "--configs",
            "no_reuse", *SUSTAINED, "--ttft-requests", "2", "--load", "4"]  # fmt: skip
    row = bench.main(argv)["configs"]["no_reuse"]
    assert row["error"].startswith("PassTimeout")
    assert row["prefill_tokens"] > 0 and row["identical"] is True and "stats" in row
