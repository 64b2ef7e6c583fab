"""The issue-10 device scripts' CPU twins (slow): each script runs end to end here on a tiny
configuration through the same shell lines the H200 call runs, so a typo cannot reach the
device. Only the sizes and devices differ (the scripts' ``ARGS``/``PRESET`` knobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(out: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(OUT=str(out), OMP_NUM_THREADS="2", **extra)
    return env


@pytest.mark.slow
def test_overflow_script_cpu_twin(tmp_path: Path) -> None:
    args = ("--num-docs 6000 --dim 16 --nlist 32 --topics 128 --nprobe 8 --budget-gb 0.0002 "
            "--llm-rate 200 --slo-search 0.05 --coverage 10 --model-batches 1 4 16 "
            "--model-repeats 1 --min-seconds 0.05 --max-batches 3 --rate-warmup 0.2 "
            "--rate-window 1 --rate-points 2 --device cpu")  # fmt: skip
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", "bench/h200_overflow_run.sh"], cwd=ROOT, env=_env(out, ARGS=args, LIMIT="300"),
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "exit code 0" in run.stdout, run.stdout
    doc = json.loads((out / "overflow.json").read_text())
    assert doc["failures"] == [] and doc["slo_rate_tier"]["points"]
    assert "phase tier_rate" in (out / "overflow.log").read_text()


@pytest.mark.slow
def test_eq2_profile_script_cpu_twin(bench_module, tmp_path: Path) -> None:
    rag_setup = bench_module("rag_setup")
    model = rag_setup.write_model(tmp_path / "model", rag_setup.SMOKE_MODEL)
    engine = tmp_path / "engine.toml"
    engine.write_text('[engine]\ndevice = "cpu"\ndtype = "float32"\nload_format = "dummy"\n'
                      "enable_prefix_caching = false\n")  # fmt: skip
    args = ("--nprobe 8 --tier-device cpu --kv-blocks 2 8 --requests 3 --prompt-tokens 8 "
            "--output-tokens 4 --batch 4 --gpu-memory-gb 0.01 --tier-gb 0 0.001")  # fmt: skip
    out = tmp_path / "out"
    env = _env(out, PRESET="smoke", MODEL=str(model), ENGINE=str(engine),
               DATA=str(tmp_path / "data"), ARGS=args, LIMIT="300")  # fmt: skip
    run = subprocess.run(
        ["bash", "bench/h200_eq2_profile.sh"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "exit code 0" in run.stdout, run.stdout + (out / "eq2_profile.log").read_text()
    doc = json.loads((out / "eq2_profile.json").read_text())
    assert [p[0] for p in doc["generation_profile"]] == [2, 8]
    assert [p[0] for p in doc["retrieval_profile"]] == [0, 1_000_000]
    from ragserve.runtime.memory_plan import load_profiles

    assert set(load_profiles(out / "eq2_profile.json")) == {
        "generation_profile",
        "retrieval_profile",
    }
