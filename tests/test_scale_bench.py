"""``bench/scale_bench.py``: capacity arithmetic (fast) and the whole harness on a local Ray
cluster at a tiny scale (slow: it starts two Ray-backed servers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    try:
        import scale_bench
    finally:
        sys.path.remove(str(BENCH))
    return scale_bench


def test_configs_and_capacity() -> None:
    sb = _module()
    assert sb.parse_config("2x1") == (2, 1) and sb.parse_config("1X4") == (1, 4)
    for bad in ("2", "0x1", "axb"):
        with pytest.raises(ValueError, match="REPLICASxSHARDS|must be >= 1"):
            sb.parse_config(bad)
    rows = [
        {"rate": 4.0, "sustained": True},
        {"rate": 8.0, "sustained": False},
        {"rate": 6.0, "sustained": True},
        {"rate": 7.0, "sustained": False},
    ]
    assert sb.capacity(rows) == (6.0, False)  # bisection refined 4 -> 6
    assert sb.capacity(rows[:1]) == (4.0, True)  # nothing failed: the top of the sweep
    assert sb.capacity([{"rate": 2.0, "sustained": False}]) == (None, False)
    with pytest.raises(ValueError, match="REPLICASxSHARDS"):
        sb.main(["--configs", "two", "--rates", "1"])  # before any index or cluster


@pytest.mark.slow
@pytest.mark.integration
def test_scale_bench_runs_two_configurations_on_ray(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    sb = _module()
    out = tmp_path / "scale"
    argv = ["--preset", "smoke", "--configs", "1x1", "2x2", "--rates", "4", "--duration", "2"]
    argv += ["--min-requests", "8", "--bisect", "0", "--ray-num-cpus", "2", "--out", str(out)]
    assert sb.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in data["rows"]] == ["1x1", "2x2"]
    for r in data["rows"]:
        assert r["num_errors"] == 0 and r["num_requests"] == 8, r["errors"]
        assert r["offered_rps"] > 0 and r["scheduler_ms_per_node"] > 0
    assert {"llm_0", "llm_1", "shard_0", "shard_1"} <= set(data["rows"][1]["workers"])
    assert set(data["summary"]) == {"1x1", "2x2"}
    assert data["summary"]["1x1"]["ratio_vs_first"] in (1.0, None)
