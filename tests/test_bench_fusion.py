"""``bench/bench_fusion.py``'s CPU twin of the H200 run: the same code on a tiny random model
(no timing assertions: every configuration runs or is recorded as failed / skipped, and the
JSON is written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench_fusion(bench_module):
    return bench_module("bench_fusion")


def test_cpu_twin_runs_every_configuration(bench_fusion, monkeypatch, tmp_path: Path) -> None:
    measure = bench_fusion.measure

    def failing_at_half(engine, p, ttft_reqs, batch_reqs, ratio):
        if ratio == 0.5:
            raise RuntimeError("injected")
        return measure(engine, p, ttft_reqs, batch_reqs, ratio)

    monkeypatch.setattr(bench_fusion, "measure", failing_at_half)
    out = tmp_path / "fusion.json"
    argv = ["--preset", "cpu-tiny", "--ratios", "0.5,1", "--selectors", "qcfuse"]
    bench_fusion.main([*argv, "--out", str(out)])
    configs = json.loads(out.read_text())["configs"]
    names = ["full", "prefix", "fuse-qcfuse-0.5", "fuse-qcfuse-1", "fuse-qcfuse-dense-1"]
    assert list(configs) == names
    assert configs["fuse-qcfuse-0.5"] == {"error": "RuntimeError: injected"}
    fused = configs["fuse-qcfuse-1"]
    p = bench_fusion.PRESETS["cpu-tiny"]
    keyed = (p["num_ttft"] + p["num_requests"]) * p["topk"] * p["passage_tokens"]
    assert fused["counters"]["num_fused_tokens"] == keyed
    assert fused["counters"]["num_recomputed_tokens"] == keyed
    assert fused["counters"]["num_fusion_store_misses"] == 0  # stored by the offline step
    assert configs["fuse-qcfuse-dense-1"]["counters"] == fused["counters"]  # same work
    for name in ("full", "prefix", "fuse-qcfuse-1", "fuse-qcfuse-dense-1"):
        row = configs[name]
        assert row["ttft_mean_s"] > 0 and row["throughput_req_s"] > 0
        assert row["ttft_speedup_vs_full"] > 0 and row["throughput_vs_prefix"] > 0
    assert configs["full"]["counters"]["num_fused_tokens"] == 0


def test_time_budget_skips_the_rest(bench_fusion, tmp_path: Path) -> None:
    out = tmp_path / "fusion.json"
    argv = ["--preset", "cpu-tiny", "--time-budget-s", "1e-9", "--out", str(out)]
    result = bench_fusion.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert all("skipped" in row for row in result["configs"].values())
    num_ratios = len(bench_fusion.PRESETS["cpu-tiny"]["ratios"])
    num_dense = len(bench_fusion.PRESETS["cpu-tiny"]["dense_ratios"])
    assert len(result["configs"]) == 2 + len(bench_fusion.SELECTORS) * num_ratios + num_dense
    with pytest.raises(ValueError, match="--selectors"):
        bench_fusion.main(["--selectors", "sift2"])
