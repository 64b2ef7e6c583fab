"""Sustained-load capacity: the method every RAG figure uses (issue 10).

A point offers Poisson arrivals at ``rate`` for ``warmup_s + window_s`` seconds. Only the
window counts:

- completed throughput = requests (any) that finished OK inside the window / window length
  (in steady state this equals the offered rate whatever the latency, by Little's law; a
  backlogged system completes at its capacity, below the rate);
- SLO attainment = share of the requests that ARRIVED inside the window that finished OK
  within the SLO (failed, aborted and timed-out ones are misses).

A rate is sustained iff completed throughput >= 95 % of the offered rate (arrivals in the
window / its length) AND SLO attainment >= 90 %. Capacity is the highest sustained rate found
by geometric bisection between a sustained ``lo`` and an unsustained ``hi`` until they are
within ``rel_tol`` (``find_capacity``). The bound says how far to trust it: ``"="`` only when
that tight bracket was reached; ``">="`` when it is a lower bound (``hi`` was sustained, or the
points ran out with the bracket still wider: ``upper`` then holds the lowest unsustained rate);
``"<"`` when nothing was sustained. With ``expand``, a start bracket that misses the capacity
is widened geometrically (down from an unsustained ``lo``, up from a sustained ``hi``) while
points remain, so a guess near a known value costs a point, not the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MIN_THROUGHPUT_SHARE = 0.95
MIN_SLO_ATTAINMENT = 0.90


def window_stats(
    responses: Sequence[Any], arrivals: Sequence[float], start: float, warmup_s: float, slo: float
) -> dict:
    """Window statistics of one point. ``arrivals[i]`` is request ``i``'s offset from
    ``start`` (monotonic seconds, as ``Response.finish_time``)."""
    if len(responses) != len(arrivals):
        raise ValueError(f"{len(responses)} responses for {len(arrivals)} arrivals")
    w0, w1 = start + warmup_s, start + float(arrivals[-1])
    if w1 <= w0:
        raise ValueError(f"no arrivals after the warm-up of {warmup_s} s")
    done = sum(r.error is None and w0 <= r.finish_time <= w1 for r in responses)
    measured = [r for r, t in zip(responses, arrivals, strict=True) if t >= warmup_s]
    met = sum(r.error is None and r.latency <= slo for r in measured)
    return {
        "window_s": w1 - w0,
        "window_requests": len(measured),
        "offered_rps": len(measured) / (w1 - w0),
        "completed_rps": done / (w1 - w0),
        "window_slo_attainment": met / max(len(measured), 1),
    }


def is_sustained(stats: dict) -> bool:
    """Completed >= 95 % of the rate actually offered in the window (the Poisson draw's, not
    the nominal rate) and >= 90 % of the window's requests within the SLO."""
    return (
        stats["completed_rps"] >= MIN_THROUGHPUT_SHARE * stats["offered_rps"]
        and stats["window_slo_attainment"] >= MIN_SLO_ATTAINMENT
    )


def reassess(points: list[dict]) -> tuple[float | None, float | None]:
    """(highest sustained offered rate, lowest unsustained offered rate) of stored points
    (rows written before the offered-rate fix of ``is_sustained`` are judged again)."""
    good = [p["offered_rps"] for p in points if is_sustained(p)]
    bad = [p["offered_rps"] for p in points if not is_sustained(p)]
    return (max(good) if good else None), (min(bad) if bad else None)


@dataclass(frozen=True)
class Capacity:
    """``rate``: the highest sustained rate measured (``None`` if none was); ``bound``: ``"="``
    (bracketed within the tolerance), ``">="`` (a lower bound) or ``"<"`` (below ``upper``);
    ``upper``: the lowest unsustained rate measured (``None`` if none was); ``points``: every
    measured (rate, sustained, stats) in order."""

    rate: float | None
    bound: str
    upper: float | None
    points: tuple[tuple[float, bool, dict], ...]


def find_capacity(
    measure: Callable[[float], dict],
    lo: float,
    hi: float,
    *,
    rel_tol: float = 0.15,
    max_points: int = 7,
    expand: bool = False,
) -> Capacity:
    """Geometric bisection of the sustained rate from the bracket ``[lo, hi]`` (module doc)."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    if not rel_tol > 0 or max_points < 2:
        raise ValueError(f"need rel_tol > 0 and max_points >= 2, got {rel_tol}, {max_points}")
    points: list[tuple[float, bool, dict]] = []
    good: float | None = None
    bad: float | None = None

    def probe(rate: float) -> bool:
        nonlocal good, bad
        ok = is_sustained(stats := measure(rate))
        points.append((rate, ok, stats))
        if ok:
            good = rate if good is None else max(good, rate)
        else:
            bad = rate if bad is None else min(bad, rate)
        return ok

    step = hi / lo
    if probe(lo):
        rate = hi
        while probe(rate) and expand and len(points) < max_points:
            rate *= step
    elif expand:
        rate = lo / step
        while not probe(rate) and len(points) < max_points:
            rate /= step
    while good is not None and bad is not None and bad / good > 1 + rel_tol:
        if len(points) >= max_points:
            break
        probe(math.sqrt(good * bad))
    if good is None:
        return Capacity(None, "<", bad, tuple(points))
    tight = bad is not None and bad / good <= 1 + rel_tol
    return Capacity(good, "=" if tight else ">=", bad, tuple(points))
