"""``bench/h200_plan.sh``'s CPU twin (slow): each call runs end to end here with ``TWIN=cpu``
(the same parts and scripts on tiny CPU configurations), so a typo cannot reach the device;
and a call whose budget runs out stops its part and still summarises it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _plan(call: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full["PATH"] = f"{Path(sys.executable).parent}:{full.get('PATH', '')}"
    full.update(OUT=str(out), OMP_NUM_THREADS="2", TWIN="cpu", **env)
    return subprocess.run(["bash", "bench/h200_plan.sh", call], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_call_1_cpu_twin(tmp_path: Path) -> None:
    run = _plan("1", tmp_path / "out", DATA=str(tmp_path / "data"))
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("overhead: orchestration share after"), summary
    assert "scheduler ms/node before" in summary[0]
    assert summary[1].startswith("kv_tiers: tree_host_pgdsf_aware:"), summary
    assert "tree_gpu_lru capacity - req/s" in summary[1]  # an ablation: no capacity search


@pytest.mark.slow
def test_call_4_cpu_twin(tmp_path: Path) -> None:
    run = _plan("4", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    line = (tmp_path / "out" / "summary.txt").read_text().strip()
    assert line.startswith("kv_capacity: vs no_reuse: ttft"), line
    assert "control agreement 1.00" in line  # CPU float32: the shuffled order changes nothing
    for name in ("no_reuse", "tree_host_pgdsf_aware", "block_cache"):
        assert f"{name} capacity [" in line, line


@pytest.mark.slow
def test_call_2_cpu_twin_cut_by_its_budget(tmp_path: Path) -> None:
    # no .git: the fallback list of test files; 45 s: the stream part is stopped by timeout
    run = _plan("2", tmp_path / "out", CALL_S="45", GIT_DIR=str(tmp_path / "no-git"))
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"gpu_tests: \d+ (skipped|passed)", summary), summary
    assert "overflow_stream: exit 124" in run.stdout, run.stdout
    assert "overflow_stream: " in summary


@pytest.mark.slow
def test_call_3_cpu_twin_runs_every_overflow_phase(tmp_path: Path) -> None:
    run = _plan("3", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    line = (tmp_path / "out" / "summary.txt").read_text().strip()
    assert line.startswith("overflow_stream: cpu "), line
    assert "failures 0" in line and "gpu_tier " in line  # the latency phase ran (p90 rows)
    assert "overflow_stream: exit 0" in run.stdout, run.stdout


@pytest.mark.slow
def test_call_5_cpu_twin_times_both_streamed_splits(tmp_path: Path) -> None:
    run = _plan("5", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    line = (tmp_path / "out" / "summary.txt").read_text().strip()
    assert line.startswith("overflow_stream: cpu -, tier -, stream "), line
    assert "gpu_tier_stream " in line and "gpu_tier_stream_omp " in line, line
    assert "failures 0" in line and "overflow_stream: exit 0" in run.stdout, run.stdout


@pytest.mark.slow
def test_call_6_cpu_twin_measures_the_cpu_scan_both_ways(tmp_path: Path) -> None:
    run = _plan("6", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    line = (tmp_path / "out" / "summary.txt").read_text().strip()
    assert line.startswith("cpu_scan: parallel / one-thread b1 "), line
    for name in ("cpu_faiss@14 b256", "cpu_faiss@1 b256", "cpu_faiss_oneshot b256"):
        assert name in line, line
    assert line.count("ids 1.00") == 9, line  # every setting returns the same ids
