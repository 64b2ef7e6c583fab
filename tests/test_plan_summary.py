"""``bench/plan_summary.py``: the device plan's one line per part, from the part's JSON (the
figures that decide the targets), and a clear line when a part left nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def summary(bench_module):
    return bench_module("plan_summary")


def test_overhead_line_has_both_targets(summary, tmp_path) -> None:
    side = {"orchestration_share": 0.0123, "orchestration_share_se": 0.0011, "num_questions": 20}
    doc = {"sides": {"before": {**side, "orchestration_share": 0.03}, "after": side},
           "median_ms_per_node": {"before": 0.8, "after": 0.3}, "after_over_before": 0.375,
           "paired_ratios": [0.3, 0.4, 0.6], "rounds_at_most_half": 2,
           "sign_test_p": 0.5, "answers_agreement": 0.95}  # fmt: skip
    (tmp_path / "overhead_compact.json").write_text(json.dumps(doc))
    line = summary.overhead(tmp_path)
    assert "after 1.23 % +- 0.11" in line and "before 3.00 %" in line
    assert "answers agree 0.95" in line
    assert "after/before 0.38" in line and "2 of 3 rounds" in line


def test_kv_line_has_ratios_and_every_config(summary, tmp_path) -> None:
    row = {"throughput_rps": 5.0, "mean_ttft_s": 0.5, "prefill_tokens": 100, "agreement": 1.0}
    best = {**row, "throughput_ratio_vs_no_reuse": 2.5, "ttft_speedup_vs_no_reuse": 4.2}
    configs = {"no_reuse": row, "tree_host_pgdsf_aware": best,
               "tree_gpu_lru": {"skipped": "time budget spent"},
               "tree_host_lru": {**row, "throughput_rps": None,
                                 "error": "PassTimeout: x"}}  # fmt: skip
    (tmp_path / "kv_tiers_compact.json").write_text(json.dumps({"configs": configs}))
    line = summary.kv_tiers(tmp_path)
    assert "ttft_speedup vs no_reuse 4.20x" in line and "throughput_ratio vs no_reuse 2.50x" in line
    assert "tree_gpu_lru skipped" in line and "tree_host_lru capacity - req/s" in line
    assert "(cut)" in line


def test_kv_capacity_line_has_ratio_intervals_and_the_control(summary, tmp_path) -> None:
    def row(rate, upper, bound, ttft):
        cap = {"rate": rate, "upper": upper, "bound": bound, "points": [{}, {}]}
        return {"capacity": cap, "mean_ttft_s": ttft, "p90_ttft_s": 2 * ttft, "agreement": 0.25}

    configs = {"no_reuse": {**row(5.0, 5.5, "=", 0.16), "control": {"agreement": 0.3}},
               "tree_host_pgdsf_aware": row(16.0, None, ">=", 0.04),
               "block_cache": {"skipped": "time budget spent"}}  # fmt: skip
    (tmp_path / "kv_capacity.json").write_text(json.dumps({"configs": configs}))
    line = summary.kv_capacity(tmp_path)
    # tree >= 16 over no_reuse in [5, 5.5): at least 16 / 5.5 = 2.91x, no upper end
    assert "vs no_reuse: ttft 4.00x (target >= 4.0) capacity >= 2.91x (target >= 2.0)" in line
    assert "vs block_cache: -" in line and "control agreement 0.30" in line
    assert "no_reuse capacity [5.00, 5.50) req/s (=, 2 probes), ttft 0.160 s" in line
    assert "tree_host_pgdsf_aware capacity [16.00, inf) req/s (>=" in line
    assert "block_cache skipped" in line
    configs["no_reuse"] = row(5.0, None, ">=", 0.16)  # two open brackets: no ratio to read
    (tmp_path / "kv_capacity.json").write_text(json.dumps({"configs": configs}))
    assert "capacity undetermined (both brackets open)" in summary.kv_capacity(tmp_path)


def test_missing_result_is_one_clear_line(tmp_path) -> None:
    run = subprocess.run([sys.executable, str(BENCH / "plan_summary.py"), "overflow_stream",
                          str(tmp_path)], capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip() == (
        f"overflow_stream: no result (overflow_stream.json missing; see {tmp_path}/part.log)"
    )


def test_overflow_line_reads_bounds_honestly(summary, tmp_path) -> None:
    doc = {"slo_rate_cpu": {"capacity_qps": 11.0, "bound": "=", "first_unsustained_qps": 11.9},
           "slo_rate_tier": {"capacity_qps": 26.0, "bound": ">=", "first_unsustained_qps": 32.2},
           "rate_points_stream": [{"rate": 33.0}],
           "points": [{"system": "gpu_tier", "p90_error": 0.05}], "failures": []}  # fmt: skip
    (tmp_path / "overflow_stream.json").write_text(json.dumps(doc))
    line = summary.overflow_stream(tmp_path)
    assert "cpu = 11.0 q/s," in line and "tier >= 26.0 q/s (< 32.2)" in line
    assert "stream - (cut after 1 points)" in line and "gpu_tier +5 %" in line


def test_cpu_scan_line_has_the_thread_ratio_per_batch(summary, tmp_path) -> None:
    def point(system, batch, qps, **extra):
        return {"system": system, "batch": batch, "qps": qps, "p90_s": batch / qps,
                "exact_ids": 1.0, **extra}  # fmt: skip

    points = [point("cpu_faiss", b, q * 8, scan_threads=14) for b, q in ((1, 12.0), (32, 12.5))]
    points += [point("cpu_faiss", b, q, scan_threads=1) for b, q in ((1, 12.0), (32, 12.5))]
    points.append(point("cpu_faiss_oneshot", 32, 110.0))
    (tmp_path / "cpu_scan.json").write_text(json.dumps({"points": points}))
    line = summary.cpu_scan(tmp_path)
    assert line.startswith("parallel / one-thread b1 8.00x, b32 8.00x | "), line
    assert "cpu_faiss@1 b32 12.5 q/s (2560 ms, ids 1.00)" in line
    assert "cpu_faiss_oneshot b32 110.0 q/s" in line
