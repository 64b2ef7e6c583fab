"""The sustained-capacity method (bench/sustained.py) and a capacity phase of the RAG bench
with the GPU tier on (CPU tensors), end to end on the smoke preset."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import rag_bench
    from sustained import find_capacity, is_sustained, reassess, window_stats
finally:
    sys.path.remove(str(BENCH))


@dataclass
class FakeResponse:
    arrival_time: float
    finish_time: float
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time


def test_window_counts_completions_inside_it_and_slo_of_its_arrivals() -> None:
    arrivals = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # warm-up 1 s: window [101, 105]
    finish = [100.5, 101.5, 102.5, 103.5, 120.0, 106.0]
    rs = [FakeResponse(100 + a, f) for a, f in zip(arrivals, finish, strict=True)]
    rs[3].error = "aborted"
    st = window_stats(rs, arrivals, 100.0, 1.0, slo=2.0)
    assert st["window_s"] == 4.0 and st["window_requests"] == 5
    assert st["completed_rps"] == 2 / 4  # 101.5, 102.5 (103.5 failed, 120 and 106 outside)
    assert st["window_slo_attainment"] == 3 / 5  # t=1, 2 and 5 within 2 s; 3 failed; 4 late
    with pytest.raises(ValueError, match="responses"):
        window_stats(rs[:2], arrivals, 100.0, 1.0, slo=2.0)


def test_bisection_brackets_a_known_capacity() -> None:
    true_capacity = 7.3

    def measure(rate: float) -> dict:
        served = min(rate, true_capacity)
        slo = 1.0 if rate <= 7.3 else 0.2
        return {"offered_rps": rate, "completed_rps": served, "window_slo_attainment": slo}

    cap = find_capacity(measure, 1.0, 64.0, rel_tol=0.05, max_points=20)
    assert cap.bound == "=" and cap.rate <= true_capacity < cap.upper
    assert cap.upper / cap.rate <= 1.05
    assert find_capacity(measure, 8.0, 16.0).bound == "<"
    high = find_capacity(measure, 1.0, 4.0)
    assert (high.bound, high.rate) == (">=", 4.0)
    assert not is_sustained({"offered_rps": 10.0, "completed_rps": 9.4, "window_slo_attainment": 1})
    poisson = {"offered_rps": 7.4, "completed_rps": 7.3, "window_slo_attainment": 0.95}
    assert is_sustained(poisson)  # judged against the arrivals drawn, not the nominal rate
    assert reassess([poisson, {**poisson, "offered_rps": 20.0}]) == (7.4, 20.0)
    with pytest.raises(ValueError, match="lo < hi"):
        find_capacity(measure, 4.0, 4.0)


def _step_system(capacity: float):
    rates: list[float] = []

    def measure(rate: float) -> dict:
        rates.append(rate)
        ok = rate <= capacity
        return {
            "offered_rps": rate,
            "completed_rps": rate if ok else capacity,
            "window_slo_attainment": 1.0 if ok else 0.5,
        }

    return measure, rates


def test_bound_is_equal_only_when_bracketed_within_the_tolerance() -> None:
    measure, rates = _step_system(40.0)
    short = find_capacity(measure, 26.0, 104.0, rel_tol=0.1, max_points=3)
    assert rates == [26.0, 104.0, 52.0]  # the 2026-12-01 stream run: 52/26 is no bracket
    assert (short.bound, short.rate, short.upper) == (">=", 26.0, 52.0)
    measure, rates = _step_system(40.0)
    full = find_capacity(measure, 26.0, 104.0, rel_tol=0.1, max_points=10)
    assert full.bound == "=" and full.rate <= 40.0 < full.upper <= 1.1 * full.rate
    assert len(rates) == len(full.points) <= 10


@pytest.mark.parametrize(("capacity", "lo", "hi"), [(11.5, 12.0, 14.0), (50.0, 24.0, 32.0)])
def test_expand_widens_a_bracket_that_misses_the_capacity(capacity, lo, hi) -> None:
    measure, rates = _step_system(capacity)
    cap = find_capacity(measure, lo, hi, rel_tol=0.1, max_points=8, expand=True)
    assert cap.bound == "=" and cap.rate <= capacity < cap.upper <= 1.1 * cap.rate
    assert len(rates) <= 8
    measure, rates = _step_system(capacity)
    tight = find_capacity(measure, lo, hi, rel_tol=0.1, max_points=2, expand=True)
    assert len(rates) == 2 and tight.bound in ("<", ">=")
    with pytest.raises(ValueError, match="max_points"):
        find_capacity(measure, lo, hi, max_points=1)


def test_capacity_phase_with_the_tier(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    phase = {"name": "cap", "systems": ["ragserve"], "workflows": ["oneshot", "llm"],
             "nprobes": [8], "capacity": [1, 4], "warmup": 0.5, "window": 1.5, "tier": True,
             "max_points": 3}  # fmt: skip
    plan.write_text(json.dumps([phase]))
    out = tmp_path / "rag"
    argv = ["--preset", "smoke", "--in-process", "--plan", str(plan), "--out", str(out),
            "--min-window", "1", "--tier-gb", "0.01", "--tier-device", "cpu"]  # fmt: skip
    assert rag_bench.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["workflow"] for r in rows} == {"oneshot", "llm"}
    for r in rows:
        assert r["tier"] is True and r["capacity_bound"] in ("=", ">=", "<")
        assert 1 <= len(r["points"]) <= 3
        assert all(p["num_errors"] == 0 for p in r["points"])
    plan.write_text(json.dumps([{**phase, "window": 5}]))
    with pytest.raises(ValueError, match="window"):
        rag_bench.main(["--preset", "smoke", "--plan", str(plan), "--out", str(tmp_path / "x")])
