"""The RAG co-scheduling benchmark's harness, end to end on a tiny configuration (no timing
assertions: it checks that every system runs every workload and the outputs are written)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    systems = {"sequential", "async", "ragserve", "split", "similarity", "speculation"}
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
