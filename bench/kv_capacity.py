"""Sustained capacity for the KV-reuse bench (issue 12): arrival streams long enough to count,
accounting that does not penalise requests still decoding at a window's end, and a capacity
search that closes to ~10 % in few probes.

A probe at ``rate`` offers a Poisson stream of ``num_warmup + num_window`` requests::

    arrivals  |w w w w w|x x x x x x x ... x x x|            drain_s            |
              0        t_w                     t_last                      t_last + drain_s
                warm-up      the window: num_window arrivals     unfinished ones aborted

- the **warm-up** arrivals bring the queue (and the cache, already warm from the replays) to
  its steady state; they are not counted;
- the **window** is ``(t_w, t_last]``, ``t_w`` the last warm-up arrival: it holds exactly
  ``num_window`` arrivals, so ``offered = num_window / (t_last - t_w)``;
- **completed** = the window's arrivals that finished OK by ``t_last + drain_s``, over the same
  length. Each window request counts once as offered and at most once as completed, whatever
  its latency: a system keeping up scores 100 % (the count of completions *inside* the window
  misses the ~rate x latency requests still decoding at its end, which with a handful of
  requests per window judged 4-request windows by quantisation);
- **SLO attainment** = the window's arrivals that finished OK within ``slo`` of arriving.

- **latency growth** = the least-squares slope of the window's latencies (finished requests)
  against their arrival offsets, in seconds per second. A system that keeps up shows none; one
  offered ``rate`` above its capacity ``mu`` builds a queue, and the n-th arrival waits
  about ``(rate / mu - 1)`` x its arrival time longer: the slope *is* the overload.

Sustained iff completed >= 95 % of offered and attainment >= 90 % (``sustained.py``'s rule,
README) **and** latency growth <= ``max_growth`` (``keeps_up``; 0.05: at most 5 % overload).
The third test is needed because the first two cannot see a modest overload in a window that
is short next to the SLO: 150 arrivals at 16 req/s span 9.4 s, and 20 % over capacity adds
only ~1.9 s of queueing by the window's end, inside a 4-s SLO and a 4-s drain. The slope
reads that overload directly (0.2), whatever the window's length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sustained import is_sustained


def probe_offsets(
    rng: np.random.Generator, rate: float, num_warmup: int, num_window: int
) -> list[float]:
    """Arrival offsets (s, the first at 0) of ``num_warmup + num_window`` arrivals with
    exponential gaps, all scaled so that the window's ``num_window`` arrivals span exactly
    ``num_window / rate`` s: the offered rate is ``rate`` itself, not a Poisson draw around it
    (+-8 % at 150 arrivals, as much as the search's tolerance), and the bursts stay."""
    if rate <= 0 or num_warmup < 1 or num_window < 2:
        raise ValueError(f"need rate > 0, num_warmup >= 1, num_window >= 2; got {rate}, "
                         f"{num_warmup}, {num_window}")  # fmt: skip
    gaps = rng.exponential(1.0, num_warmup + num_window)
    gaps[0] = 0.0
    gaps *= (num_window / rate) / gaps[num_warmup:].sum()
    return np.cumsum(gaps).tolist()


def arrival_window_stats(
    responses: Sequence[Any], offsets: Sequence[float], num_warmup: int, slo: float
) -> dict:
    """Window statistics of one probe (module doc). ``responses[i]`` has ``error`` (None if it
    finished OK by the drain cutoff) and ``latency`` (s from its arrival)."""
    if len(responses) != len(offsets) or not 1 <= num_warmup < len(offsets) - 1:
        raise ValueError(f"{len(responses)} responses, {len(offsets)} arrivals, "
                         f"{num_warmup} warm-up")  # fmt: skip
    window = responses[num_warmup:]
    length = offsets[-1] - offsets[num_warmup - 1]
    done = [(t, r.latency) for r, t in zip(window, offsets[num_warmup:], strict=True)
            if r.error is None]  # fmt: skip
    met = sum(latency <= slo for _, latency in done)
    growth = None
    if len(done) >= 3:
        t, latency = np.asarray(done).T
        growth = float(np.polyfit(t, latency, 1)[0]) if np.ptp(t) > 0 else None
    return {
        "window_s": length,
        "window_requests": len(window),
        "offered_rps": len(window) / length,
        "completed_rps": len(done) / length,
        "window_slo_attainment": met / len(window),
        "latency_growth": growth,
    }


def keeps_up(stats: dict, max_growth: float = 0.05) -> bool:
    """``sustained.is_sustained`` and latency growth at most ``max_growth`` s/s (module doc)."""
    growth = stats.get("latency_growth")
    return is_sustained(stats) and growth is not None and growth <= max_growth


def search_capacity(
    measure: Callable[[float], dict],
    estimate: float,
    *,
    rel_tol: float = 0.10,
    max_probes: int = 4,
    fits: Callable[[float], bool] = lambda rate: True,
    judge: Callable[[dict], bool] = keeps_up,
) -> dict:
    """The highest sustained rate, by probes at ``estimate``, then stepping up (or down) by
    ``1 + rel_tol``, the step squared after each probe that does not change the verdict
    (galloping), then geometric bisection until the lowest unsustained rate is within
    ``1 + rel_tol`` of the highest sustained one (``judge``: keeps up or not).
    ``fits(rate)`` False stops before a probe (the time budget). Returns ``rate`` (highest
    sustained, None if none), ``upper`` (lowest unsustained above it, None if none),
    ``bound`` ("=": bracketed within the tolerance; "~": bracketed wider; ">=": no
    unsustained probe; "<": no sustained one, ``upper`` the lowest probed), ``stopped`` (why
    it ended early, or None), ``points`` (stats per probe)."""
    if estimate <= 0 or rel_tol <= 0 or max_probes < 1:
        raise ValueError(f"need estimate, rel_tol > 0 and max_probes >= 1; got {estimate}, "
                         f"{rel_tol}, {max_probes}")  # fmt: skip
    points: list[dict] = []
    good = bad = None
    rate, step, stopped = estimate, 1.0 + rel_tol, None
    while True:
        if good is not None and bad is not None:
            if bad / good <= (1.0 + rel_tol) * (1 + 1e-9):
                break
            rate = math.sqrt(good * bad)
        if len(points) >= max_probes:
            stopped = f"max_probes ({max_probes})"
            break
        if not fits(rate):
            stopped = f"time budget (next probe {rate:.3g} req/s)"
            break
        stats = measure(rate) | {"rate": rate}
        stats["sustained"] = judge(stats)
        points.append(stats)
        good, bad = _bracket(points)
        if good is None:
            rate, step = rate / step, step * step
        elif bad is None:
            rate, step = rate * step, step * step
    if good is None:
        bound = "<"
    elif bad is None:
        bound = ">="
    else:
        bound = "=" if bad / good <= (1.0 + rel_tol) * (1 + 1e-9) else "~"
    return {
        "rate": good,
        "upper": bad if good is not None else min((p["rate"] for p in points), default=None),
        "bound": bound,
        "stopped": stopped,
        "points": points,
    }


def _bracket(points: list[dict]) -> tuple[float | None, float | None]:
    """(highest sustained rate, lowest unsustained rate above it) of the probes so far. Every
    probe lies beyond the bracket's open side or inside it, so no unsustained probe falls below
    a sustained one: a noisy verdict at the edge moves the bracket, it cannot contradict it."""
    good = max((p["rate"] for p in points if p["sustained"]), default=None)
    above = [p["rate"] for p in points if not p["sustained"] and p["rate"] > (good or 0.0)]
    return good, min(above, default=None)
