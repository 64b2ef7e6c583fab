"""The RAG co-scheduling benchmark's harness, end to end on a tiny configuration (no timing
assertions: it checks that every system runs every workload and the outputs are written)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_rag_bench_smoke(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import rag_bench
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "rag"
    assert rag_bench.main(["--preset", "smoke", "--in-process", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    systems = {"sequential", "stagewise", "async", "ragserve", "split", "similarity", "speculation"}
    assert {(r["system"], r["workflow"]) for r in rows} == {(s, "mix") for s in systems}
    for r in rows:
        assert r["num_requests"] == 4 and r["num_errors"] == 0, r["errors"]
        assert r["latency_mean_s"] > 0 and 0.0 <= r["slo_attainment"] <= 1.0
        assert r["ttft_mean_s"] <= r["latency_p90_s"] + 1e-9
    by = {(r["system"], r["workflow"]): r for r in rows}
    assert by[("ragserve", "mix")]["spec_resolved"] > 0  # speculation ran
    assert by[("async", "mix")]["spec_accuracy"] is None
    assert data["meta"]["preset"]["nprobes"] == [8]
    assert [p.name for p in out.glob("*.png")] == ["latency_mix_nprobe8.png"]


def test_rag_bench_plan_timeouts_and_saturation(tmp_path: Path) -> None:
    """A plan's phases run on one server; requests past the point timeout are aborted and
    count as SLO misses; a system below ``--stop-below`` skips its higher rates."""
    sys.path.insert(0, str(BENCH))
    try:
        import rag_bench
    finally:
        sys.path.remove(str(BENCH))
    plan = tmp_path / "plan.json"
    phases = [
        {"name": "cut", "systems": ["stagewise", "async"], "workflows": ["oneshot"],
         "rates": [16, 8], "nprobes": [4], "timeout": 0.0},
        {"name": "full", "systems": ["sequential", "ragserve"], "workflows": ["irg"],
         "rates": [8], "nprobes": [8]},
    ]  # fmt: skip
    plan.write_text(json.dumps([{"systems": ["async"], "rates": [0]}]))
    with pytest.raises(ValueError, match="must be > 0"):  # before any index or server
        rag_bench.main(["--preset", "smoke", "--plan", str(plan), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x" / "data").exists()  # nothing was built
    plan.write_text(json.dumps([{"systems": ["vllm"]}]))
    with pytest.raises(ValueError, match="unknown systems"):
        rag_bench.main(["--preset", "smoke", "--plan", str(plan), "--out", str(tmp_path / "x")])
    plan.write_text(json.dumps(phases))
    out = tmp_path / "rag"
    argv = ["--preset", "smoke", "--in-process", "--plan", str(plan), "--out", str(out),
            "--stop-below", "0.99"]  # fmt: skip
    assert rag_bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    cut = [r for r in rows if r["phase"] == "cut"]
    assert [(r["rate"], "skipped" in r) for r in cut] == [(8, False)] * 2 + [(16, True)] * 2
    for r in cut[:2]:
        assert r["num_timed_out"] >= 1 and r["slo_attainment"] <= 0.75
    full = [r for r in rows if r["phase"] == "full"]
    assert {(r["system"], r["nprobe"]) for r in full} == {("sequential", 8), ("ragserve", 8)}
    assert all(r["num_errors"] == 0 and r["slo_attainment"] == 1.0 for r in full)


def test_bench_graphs_fix_the_output_length_on_their_nodes() -> None:
    """Every generation node of the bench's workflows asks for exactly ``max_tokens`` (so a
    speculative generation, made from the node, matches the real task it stands for)."""
    sys.path.insert(0, str(BENCH))
    try:
        import rag_bench
    finally:
        sys.path.remove(str(BENCH))
    from ragserve.scheduler.messages import GenerationParams

    graphs = rag_bench.workflow_graphs(rag_bench.PRESETS["smoke"])
    generation = [n for g in graphs.values() for n in g.nodes.values() if n.kind == "generation"]
    assert len(generation) >= len(graphs)
    for node in generation:
        params = GenerationParams.from_any(node)
        assert params.ignore_eos and params.stop == ()
