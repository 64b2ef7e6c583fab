"""Every plan in ``bench/plans`` parses (``rag_bench.phases``: known systems and workflows,
capacity brackets, windows), and (slow) the H200 tier plan runs end to end on the smoke
preset with its phases' order, workflows and tier switches intact, scaled to CPU rates."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
PLANS = sorted((BENCH / "plans").glob("*.json"))


@pytest.mark.parametrize("plan", PLANS, ids=[p.stem for p in PLANS])
def test_plan_parses(bench_module, plan: Path) -> None:
    rag_bench = bench_module("rag_bench")
    args = rag_bench.build_parser(argparse.ArgumentParser()).parse_args(
        ["--preset", "h200", "--plan", str(plan)]
    )
    preset = rag_bench.PRESETS["h200"]
    args.workflows, args.rates = list(preset.workflows), list(preset.rates)  # as run() does
    phases = rag_bench.phases(args, 256)
    assert phases and all(ph["points"] for ph in phases)
    for ph in phases:
        for point in ph["points"]:
            assert point["nprobe"] in (128, 256, 512)
            if "capacity" in point:
                assert point["window"] >= 30  # the sustained-load method


def test_tier_plan_4_covers_the_missing_points() -> None:
    raw = json.loads((BENCH / "plans" / "h200_tier_capacity4.json").read_text())
    got = {(ph["workflows"][0], ph["nprobes"][0], ph.get("tier")) for ph in raw}
    assert got == {
        ("oneshot", 256, True),
        ("multistep", 256, True),
        ("llm-multistep", 256, None),
        ("multistep", 256, False),
        ("oneshot", 512, True),
        ("oneshot", 512, False),
    }
    assert raw[0]["capacity"] == [60, 68]  # run 3's cap at 56 was a bug (fixed in f506af4)


@pytest.mark.slow
def test_tier_plan_4_runs_on_the_smoke_preset(bench_module, tmp_path: Path) -> None:
    rag_bench = bench_module("rag_bench")
    raw = json.loads((BENCH / "plans" / "h200_tier_capacity4.json").read_text())
    for ph in raw:  # same phases, CPU-sized: rates, windows, probe widths
        ph.update(capacity=[0.5, 1.0], warmup=0.2, window=1.5, timeout=5, nprobes=[8])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(raw))
    out = tmp_path / "rag"
    argv = ["--preset", "smoke", "--in-process", "--plan", str(plan), "--out", str(out),
            "--min-window", "1", "--tier-gb", "0.01", "--tier-device", "cpu"]  # fmt: skip
    assert rag_bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["phase"] for r in rows] == [ph["name"] for ph in raw]
    for r, ph in zip(rows, raw, strict=True):
        assert r["workflow"] == ph["workflows"][0] and r["tier"] == ph.get("tier")
        assert r["points"], r
        for point in r["points"]:
            assert point["num_errors"] == 0, point.get("errors")
