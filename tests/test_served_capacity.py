"""The served-capacity bench (issue 28) end to end on CPU at a tiny scale, so the script the
H200 run uses cannot rot: a ``ragserve serve`` process (tiny model, tiny index, a GPU-index
tier placed on the CPU), HTTP load from this process, every system and ablation switched in
turn. No timing is asserted: only that each system ran as it says it did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _import(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def test_served_capacity_cpu_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every system, the server on a thread here (the same ``ragserve serve`` build as the
    device's separate process: ``served_server.build_app``)."""
    bench = _import("served_capacity")
    monkeypatch.setenv("SERVED_PRESET", "smoke")
    out = tmp_path / "served"
    argv = ["--preset", "smoke", "--in-process", "--server-mode", "thread", "--out", str(out),
            "--tier-gb", "0.001", "--tier-device", "cpu", "--tier-scan", "dense", "--warmup",
            "0.1", "--window", "0.5", "--drain", "30", "--sample-s", "0.2", "--rates",
            "ragserve=2,4", "llm-alone=find:2,4,2", "baseline=4", "ablations=auto"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    pairs = [(r["system"], r["rate"]) for r in doc["rows"]]
    # the ablations run at ragserve's capacity (its lowest rate when nothing was sustained)
    at = bench.ablation_rates(doc["rows"], 1)
    # the search: 2 first, then 4 if 2 was sustained, else 1 (2 points at most)
    llm = [r for r in doc["rows"] if r["system"] == "llm-alone"]
    assert [r["rate"] for r in llm] == [2.0, 4.0 if llm[0]["sustained"] else 1.0]
    good = [r["rate"] for r in llm if r["sustained"]]
    assert doc["meta"]["capacity"]["llm-alone"][0] == (max(good) if good else None)
    assert pairs == [("ragserve", 2.0), ("ragserve", 4.0), *((r["system"], r["rate"]) for r in llm),
                     *((a, at[0]) for a in bench.ABLATIONS[:3]), ("baseline", 4.0),
                     ("cosched-all", at[0]), ("no-tier", at[0])]  # fmt: skip
    for r in doc["rows"]:
        assert r["num_errors"] == 0, r["errors"]
        assert r["latency_p50_s"] <= r["latency_p90_s"] <= r["latency_p99_s"]
        assert r["ttft_p50_s"] <= r["latency_p99_s"] and r["sustained"] in (True, False)
        assert r["util_samples"] >= 1 and r["cpu_util_pct"] is not None
        assert set(r["p90_by_workflow"]) == {
            {"llm-alone": "llm-", "fusion-on": "fused-"}.get(r["system"], "") + n
            for n in ("oneshot", "hyde", "multistep", "irg", "recomp")
        }
    by_system = {r["system"]: r for r in doc["rows"]}
    shipped = by_system["ragserve"]
    everything = ["split", "gen_chunks", "similarity", "speculation"]
    # auto: this 1 MB tier holds only part of the index, so every transform runs
    assert shipped["cosched"] == everything and shipped["kv_hit_tokens"] > 0  # KV tree on
    assert by_system["cosched-all"]["cosched"] == everything
    assert shipped["fused_tokens"] == 0 and shipped["tier_hit_rate"] is not None
    assert by_system["no-cosched"]["cosched"] == [] and by_system["baseline"]["cosched"] == []
    assert by_system["no-kv-reuse"]["kv_hit_tokens"] == 0
    assert by_system["baseline"]["kv_hit_tokens"] == 0
    assert by_system["fusion-on"]["fused_tokens"] > 0
    assert by_system["no-tier"]["tier_hit_rate"] is None  # dropped for the last system
    # each point's tier scans per strategy (--tier-scan dense); none once the tier is dropped
    assert shipped["tier_scans"]["dense"] > 0 and by_system["baseline"]["tier_scans"]["dense"] > 0
    assert by_system["no-tier"]["tier_scans"] is None
    assert doc["meta"]["seed"] == 0 and "--gpu-index-gb" in doc["meta"]["server_cmd"]
    assert (out / "served_capacity.png").stat().st_size > 0
    table = bench.report(doc)
    assert "| ragserve | 2 |" in table and "| no-tier |" in table


@pytest.mark.slow
def test_served_capacity_server_process(tmp_path: Path) -> None:
    """The device's path: the server as its own process (``served_server.py serve``), SIGTERM
    at the end; one system, two rates."""
    bench = _import("served_capacity")
    out = tmp_path / "served"
    argv = ["--preset", "smoke", "--in-process", "--out", str(out), "--warmup", "0.3",
            "--window", "1", "--drain", "30", "--sample-s", "0.2", "--rates", "ragserve=2,4",
            "no-kv-reuse=2", "--no-plot"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [(r["system"], r["rate"], r["num_errors"]) for r in doc["rows"]] == [
        ("ragserve", 2.0, 0), ("ragserve", 4.0, 0), ("no-kv-reuse", 2.0, 0)]  # fmt: skip
    assert (
        doc["meta"]["server_start_s"] > 0
        and "closing the Server" in (out / "server.log").read_text()
    )


def test_served_capacity_rates_checked_before_anything_starts(tmp_path: Path) -> None:
    bench = _import("served_capacity")
    with pytest.raises(ValueError, match="unknown system"):
        bench.main(["--out", str(tmp_path / "x"), "--rates", "vllm=1"])
    with pytest.raises(ValueError, match="must be > 0"):
        bench.main(["--out", str(tmp_path / "x"), "--rates", "ragserve=0,2"])
    assert not (tmp_path / "x").exists()
    assert bench.parse_rates(["ablations=auto", "ragserve=4,2"])["ragserve"] == [2.0, 4.0]
    assert bench.parse_rates(["ragserve=find:8,16,6"])["ragserve"] == bench.Search(8, 16, 6)
    for bad in ("find:16,8,6", "find:8,16", "find:8,16,1"):
        with pytest.raises(ValueError, match="find:LO,HI,N"):
            bench.parse_rates([f"ragserve={bad}"])
    rows = [{"system": "ragserve", "rate": r, "sustained": ok}
            for r, ok in ((2, True), (4, True), (8, False), (16, False))]  # fmt: skip
    assert bench.ablation_rates(rows, 2) == [4, 8] and bench.ablation_rates(rows, 1) == [4]


def test_served_workflows_are_the_builtins_at_fixed_length_and_their_rooflines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SERVED_PRESET", "smoke")
    wf = _import("served_workflows")
    for name in wf.NAMES:
        graph, llm = getattr(wf, name)(), getattr(wf, f"llm_{name}")()
        gens = [n for n in graph.nodes.values() if n.kind == "generation"]
        assert gens and all(n.ignore_eos and n.stop == () for n in gens)
        assert {n.kind for n in llm.nodes.values()} == {"generation"}  # no retrieval
        assert len(llm.nodes) == len(gens)  # one generation node for each of the workflow's
        fused = getattr(wf, f"fused_{name}")()
        ratios = {n.fusion_ratio for n in fused.nodes.values() if n.kind == "generation"}
        assert wf.FUSION_RATIO in ratios
    flags = wf.workflow_flags()
    assert flags.count("--workflow") == 15 and "llm-irg=served_workflows:llm_irg" in flags
