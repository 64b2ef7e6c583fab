"""``bench/kv_capacity.py``: the probe stream, the arrival-based window accounting and the
capacity search, against a simulated system with a known capacity (fast, no engine)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest


@pytest.fixture(scope="module")
def kc(bench_module):
    return bench_module("kv_capacity")


def test_probe_offsets_offer_exactly_the_rate(kc) -> None:
    offsets = kc.probe_offsets(np.random.default_rng(0), 5.0, 8, 150)
    assert len(offsets) == 158 and offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] - offsets[7] == pytest.approx(150 / 5.0)  # the window: 150 arrivals
    gaps = np.diff(offsets)
    assert gaps.std() > 0.5 * gaps.mean()  # still bursty (exponential gaps: std = mean)
    with pytest.raises(ValueError, match="num_window >= 2"):
        kc.probe_offsets(np.random.default_rng(0), 5.0, 1, 1)


def _resp(error=None, latency=1.0):
    return SimpleNamespace(error=error, latency=latency)


def test_window_counts_each_arrival_once_whatever_its_latency(kc) -> None:
    offsets = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # 2 warm-up, then 4 arrivals in (1, 5]
    responses = [
        _resp("finish reason abort"),  # the two warm-up arrivals: not counted
        _resp(),
        _resp(latency=3.5),  # finished after the window's end, within the drain: completed
        _resp("finish reason abort"),  # not finished by the drain cutoff: a miss
        _resp(latency=9.0),  # completed, but past the SLO
        _resp(),
    ]
    stats = kc.arrival_window_stats(responses, offsets, 2, slo=4.0)
    assert stats == {
        "window_s": 4.0,
        "window_requests": 4,
        "offered_rps": 1.0,
        "completed_rps": 0.75,
        "window_slo_attainment": 0.5,
        "latency_growth": pytest.approx(-1.5 / (14 / 3)),  # the slope over t = 2, 4, 5
    }
    with pytest.raises(ValueError, match="warm-up"):
        kc.arrival_window_stats(responses, offsets, 0, slo=4.0)


def test_latency_growth_reads_the_overload(kc) -> None:
    rng = np.random.default_rng(1)
    offsets = kc.probe_offsets(rng, 16.0, 24, 150)
    noise = rng.uniform(0.0, 0.4, len(offsets))
    for overload, verdict in ((0.0, True), (0.04, True), (0.2, False)):
        # each arrival waits `overload` x its arrival time on top of ~1 s of service
        responses = [
            _resp(latency=0.8 + n + overload * t) for t, n in zip(offsets, noise, strict=True)
        ]
        stats = kc.arrival_window_stats(responses, offsets, 24, slo=4.0)
        assert stats["latency_growth"] == pytest.approx(overload, abs=0.01)
        # completion and SLO alone pass all three: the window (9.4 s) is short next to the SLO
        assert (
            stats["completed_rps"] == stats["offered_rps"] and stats["window_slo_attainment"] == 1
        )
        assert kc.keeps_up(stats) is verdict


def _system(capacity: float, calls: list[float]):
    """A server that keeps up below ``capacity`` and backs up above it (latency growing by the
    overload; completion and SLO met, as in a window short next to the SLO)."""

    def measure(rate: float) -> dict:
        calls.append(rate)
        return {"offered_rps": rate, "completed_rps": rate, "window_slo_attainment": 1.0,
                "latency_growth": max(rate / capacity - 1.0, 0.0)}  # fmt: skip

    return measure


def test_search_closes_to_the_tolerance_from_a_close_estimate(kc) -> None:
    calls: list[float] = []
    cap = kc.search_capacity(_system(10.0, calls), 9.0, rel_tol=0.1, max_probes=5)
    # 9 ok, x1.1 ok, x1.21 not, then one bisection: within 10 %
    assert calls == pytest.approx([9.0, 9.9, 9.9 * 1.21, math.sqrt(9.9 * 9.9 * 1.21)])
    assert cap["bound"] == "=" and cap["stopped"] is None
    assert cap["rate"] == pytest.approx(9.9) and cap["upper"] == pytest.approx(9.9 * 1.1)
    assert cap["rate"] <= 10.0 < cap["upper"] <= 1.1 * cap["rate"] * (1 + 1e-9)
    assert [p["sustained"] for p in cap["points"]] == [True, True, False, False]


def test_search_gallops_down_and_says_when_it_stopped(kc) -> None:
    calls: list[float] = []
    cap = kc.search_capacity(_system(4.0, calls), 20.0, rel_tol=0.1, max_probes=3)
    assert calls == pytest.approx([20.0, 20 / 1.1, 20 / 1.1 / 1.21])
    assert cap["bound"] == "<" and cap["rate"] is None
    assert cap["upper"] == pytest.approx(calls[-1]) and cap["stopped"] == "max_probes (3)"
    calls.clear()
    cap = kc.search_capacity(_system(4.0, calls), 20.0, rel_tol=0.1, max_probes=20)
    assert cap["bound"] == "=" and cap["rate"] <= 4.0 < cap["upper"] <= 1.1 * cap["rate"] * 1.001


def test_search_stops_before_a_probe_that_does_not_fit(kc) -> None:
    calls: list[float] = []
    cap = kc.search_capacity(_system(100.0, calls), 10.0, fits=lambda rate: rate < 12.0)
    assert calls == pytest.approx([10.0, 11.0])  # 11 x 1.21 = 13.3 would not fit
    assert cap["bound"] == ">=" and cap["rate"] == pytest.approx(11.0) and cap["upper"] is None
    assert cap["stopped"].startswith("time budget")
    cap = kc.search_capacity(_system(100.0, []), 10.0, fits=lambda rate: False)
    assert cap["points"] == [] and cap["rate"] is None and cap["upper"] is None
