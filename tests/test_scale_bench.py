"""``bench/scale_bench.py``: configuration and bracket parsing, capacity read off cut-short
points, ratios (fast); the whole harness on a local Ray cluster at a tiny scale with the GPU
tier's CPU twin, through the device script ``bench/h200x2_scale_run.sh`` (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    try:
        import scale_bench
    finally:
        sys.path.remove(str(BENCH))
    return scale_bench


def test_configs_and_brackets() -> None:
    sb = _module()
    assert sb.parse_config("2x1") == (2, 1) and sb.parse_config("1X4") == (1, 4)
    for bad in ("2", "0x1", "axb"):
        with pytest.raises(ValueError, match="REPLICASxSHARDS|must be >= 1"):
            sb.parse_config(bad)
    brackets = sb.parse_brackets(["40:70", "2:70:140"])
    assert brackets == {None: (40.0, 70.0), 2: (70.0, 140.0)}
    assert sb.bracket(brackets, 1) == (40.0, 70.0) and sb.bracket(brackets, 2) == (70.0, 140.0)
    assert sb.bracket(brackets, 4) == (160.0, 280.0)  # one replica's, times 4
    with pytest.raises(ValueError, match="no bracket for 3 replicas"):
        sb.bracket(sb.parse_brackets(["2:70:140"]), 3)
    for bad in ("70:40", "x:1", "1:2:3:4", "0:1:2"):
        with pytest.raises(ValueError, match="capacity:"):
            sb.parse_brackets([bad])
    with pytest.raises(ValueError, match="REPLICASxSHARDS"):
        sb.main(["--configs", "two", "--capacity", "1:2"])  # before any index or cluster
    with pytest.raises(ValueError, match="window must be >= 30"):
        sb.main(["--configs", "1x1", "--capacity", "1:2", "--window", "5"])


def test_capacity_of_a_cut_short_bisection_and_ratios() -> None:
    sb = _module()
    pts = [{"rate": 40.0, "sustained": True}, {"rate": 70.0, "sustained": False}]
    assert sb.from_points(pts) == {"capacity_rps": 40.0, "bound": "=", "upper_rps": 70.0}
    assert sb.from_points(pts[:1]) == {"capacity_rps": 40.0, "bound": ">=", "upper_rps": None}
    assert sb.from_points(pts[1:]) == {"capacity_rps": None, "bound": "<", "upper_rps": 70.0}
    assert sb.from_points([]) == {"capacity_rps": None, "bound": ">=", "upper_rps": None}
    entries = [
        {"config": "1x1", "capacity_rps": 50.0, "bound": "=", "upper_rps": 60.0,
         "points": [{"scheduler_ms_per_node": 0.5}, {"scheduler_ms_per_node": 0.4}]},
        {"config": "2x1", "capacity_rps": 99.0, "bound": "=", "upper_rps": 120.0,
         "points": [{"scheduler_ms_per_node": 0.6}]},
    ]  # fmt: skip
    out = sb.summarize_configs(entries)
    assert out["1x1"]["ratio_vs_first"] == 1.0 and out["1x1"]["scheduler_ms_per_node"] == 0.4
    assert out["2x1"]["ratio_vs_first"] == pytest.approx(1.98)
    assert out["2x1"]["ratio_range"] == pytest.approx([99 / 60, 120 / 50])


@pytest.mark.slow
@pytest.mark.integration
def test_device_script_cpu_twin_runs_one_and_two_replicas(tmp_path: Path) -> None:
    """The device script end to end on CPU at the smoke scale (tier on ``cpu``): a typo in it
    or in the harness fails here, not on the GPUs."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "MODEL": str(tmp_path / "no-model"),
        "RUN": str(tmp_path / "run"),
        "OUT": str(out),
        "PRESET": "smoke",
        "CONFIGS": "1x1 2x1",
        "CAPACITY": "2:8",
        "NPROBE": "8",
        "TIER_GB": "0.001",
        "TIER_DEVICE": "cpu",
        "WARMUP": "1",
        "WINDOW": "3",
        "MIN_WINDOW": "1",
        "MAX_POINTS": "2",
        "GPUS": "0",
        "CPUS": "2",
        "BUDGET_S": "400",
    }
    run = subprocess.run(
        ["bash", "bench/h200x2_scale_run.sh", "start", "420"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and "finished" in run.stdout, run.stdout + run.stderr
    data = json.loads((out / "results.json").read_text())
    assert [e["config"] for e in data["configs"]] == ["1x1", "2x1"]
    for e in data["configs"]:
        assert "error" not in e, e.get("error")
        assert e["bracket"] == [2.0 * e["replicas"], 8.0 * e["replicas"]]
        # two rates, or one when the bracket's low end already fails (a busy machine)
        assert len(e["points"]) == 2 or (len(e["points"]) == 1 and e["bound"] == "<")
        assert all(p["num_errors"] == 0 and p["scheduler_ms_per_node"] > 0 for p in e["points"])
        holder = e["points"][0]["workers"]["retrieval"]
        assert holder["tier_clusters"] > 0  # the coordinator holds the tier (one shard)
    assert data["summary"]["1x1"]["ratio_vs_first"] in (1.0, None)
    assert (out / "run.log").stat().st_size > 0
