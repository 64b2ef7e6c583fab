"""The overflow bench's SLO-bound query rate (``bench/bench_tier_overflow.py``, phases 6 and
7's rate): an open-loop dispatcher over Poisson arrivals, judged by ``sustained.py``'s window
statistics, searched by ``find_capacity``; CPU-only, with the plan's tier and streamed. Each
phase function takes the run's ``args``, ``Results``, state dict and device."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench_gpu_tier import Results
from sustained import find_capacity, window_stats
from tier_overflow_latency import place_streamed

logger = logging.getLogger("bench_tier_overflow")


def serve_open_loop(
    search: Callable[[np.ndarray], Any],
    queries: np.ndarray,
    arrivals: np.ndarray,
    *,
    max_batch: int,
    timeout: float,
) -> np.ndarray:
    """Finish offsets (seconds from the start; ``nan``: not served) of queries arriving at
    ``arrivals`` (ascending offsets): one dispatcher takes every arrived query, at most
    ``max_batch``, as one batch; it stops ``timeout`` s after the last arrival."""
    n = len(arrivals)
    finish = np.full(n, np.nan)
    start = time.monotonic()
    i = 0
    while i < n:
        now = time.monotonic() - start
        if now > arrivals[-1] + timeout:
            break
        if arrivals[i] > now:
            time.sleep(min(arrivals[i] - now, 0.05))
            continue
        j = min(int(np.searchsorted(arrivals, now, side="right")), i + max_batch)
        search(queries[np.arange(i, j) % len(queries)])
        finish[i:j] = time.monotonic() - start
        i = j
    return finish


def rate_point(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, rate: float, args: Any
) -> dict:
    """One open-loop point at ``rate`` queries/s: ``warmup + window`` s of Poisson arrivals
    (at most ``--rate-queries``), judged by ``sustained.py``'s window statistics."""
    rng = np.random.default_rng(int(rate * 1000) + 7)
    n = min(args.rate_queries, int(math.ceil(rate * (args.rate_warmup + args.rate_window))))
    n = max(3, n, args.rate_min_queries)  # NOTE: the sustained method's >= 200 requests
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    finish = serve_open_loop(
        search, queries, arrivals, max_batch=args.max_batch, timeout=args.slo_search
    )
    served = ~np.isnan(finish)
    latency = np.where(served, finish - arrivals, np.inf)
    responses = [
        SimpleNamespace(error=None if ok else "timeout", finish_time=f, latency=lat)
        for ok, f, lat in zip(served, np.nan_to_num(finish, nan=-1.0), latency, strict=True)
    ]
    warm = min(args.rate_warmup, float(arrivals[len(arrivals) // 4]))
    stats = window_stats(responses, arrivals, 0.0, warm, args.slo_search)
    done = latency[np.isfinite(latency)]
    p90 = float(np.percentile(latency, 90))
    stats.update(
        rate=rate,
        num_queries=n,
        served=int(served.sum()),
        p50_s=float(np.percentile(done, 50)) if len(done) else None,
        p90_s=p90 if math.isfinite(p90) else None,
    )
    logger.info("rate point %s", stats)
    return stats


def slo_rate(
    search: Callable[[np.ndarray], Any],
    queries: np.ndarray,
    lo: float,
    hi: float,
    args: Any,
    record: Callable[[dict], None] = lambda point: None,
) -> dict:
    """The highest sustained open-loop rate from the bracket ``[lo, hi]`` (``find_capacity``);
    ``record`` gets each point's statistics as it is measured (a cut-off run keeps them)."""

    def measure(rate: float) -> dict:
        stats = rate_point(search, queries, rate, args)
        record(stats)
        return stats

    cap = find_capacity(
        measure,
        lo,
        hi,
        rel_tol=args.rate_tol,
        max_points=args.rate_points,
        expand=True,
    )
    return {
        "capacity_qps": cap.rate,
        "bound": cap.bound,
        "first_unsustained_qps": cap.upper,
        "points": [{"rate": r, "sustained": ok, **st} for r, ok, st in cap.points],
    }


def rate_clusters(args: argparse.Namespace, res: Results, st: dict) -> list[int]:
    """The tier's lists in the rate phases: the plan's (Algorithm 1 at ``--llm-rate``), or
    with ``--rate-placement fill`` the hottest lists that fill the budget at the tier's
    chunk prices (a plan that needs no tier at the LLM's rate still has a budget to use)."""
    if args.rate_placement == "plan":
        return list(st["plan"].cluster_ids)
    from ragserve.retrieval.partition import fill_budget

    got = fill_budget(st["counts"], st["cbytes"], st["budget"])
    res.doc["rate_placement"] = {"mode": "fill", "num_clusters": len(got.cluster_ids)}
    return [int(c) for c in got.cluster_ids]


def recorder(res: Results, system: str) -> Callable[[dict], None]:
    """Saves each rate point under ``rate_points_<system>`` as it is measured."""
    points = res.doc.setdefault(f"rate_points_{system}", [])

    def record(stats: dict) -> None:
        points.append(dict(stats))
        res.save()

    return record


def _search_rate(
    args: argparse.Namespace, res: Results, st: dict, system: str, bracket: tuple[float, float]
) -> float | None:
    """The SLO-bound rate of the index as placed now, from ``bracket``, in
    ``res.doc["slo_rate_<system>"]``; returns its capacity (queries/s, or None)."""
    index = st["index"]
    lo, hi = bracket
    res.doc[f"slo_rate_{system}"] = slo_rate(
        lambda b: index.search(b, args.topk, args.nprobe),
        st["q"],
        lo,
        hi,
        args,
        recorder(res, system),
    )
    return res.doc[f"slo_rate_{system}"]["capacity_qps"]


def cpu_rate(args: argparse.Namespace, res: Results, st: dict, device: str) -> None:
    _search_rate(args, res, st, "cpu", args.cpu_rate or _bracket(st["model"], args))


def tier_rate(args: argparse.Namespace, res: Results, st: dict, device: str) -> None:
    index = st["index"]
    clusters = rate_clusters(args, res, st)
    index.set_gpu_tier(st["budget"], device=device, clusters=clusters, stream_cold="off")
    cpu = res.doc.get("slo_rate_cpu", {}).get("capacity_qps")
    tier = _search_rate(
        args, res, st, "tier", args.tier_rate or ((cpu or 1.0) * 1.5, (cpu or 1.0) * 8.0)
    )
    index.drop_gpu_tier()
    if cpu and tier:
        res.doc["slo_rate_ratio"] = tier / cpu


def stream_rate(args: argparse.Namespace, res: Results, st: dict, device: str) -> None:
    index = st["index"]
    place_streamed(args, res, st, device, rate_clusters(args, res, st))
    cpu = res.doc.get("slo_rate_cpu", {}).get("capacity_qps")
    tier = res.doc.get("slo_rate_tier", {}).get("capacity_qps")
    base = tier or (cpu or 1.0) * 2.0
    got = _search_rate(args, res, st, "stream", args.stream_rate or (base * 0.75, base * 4.0))
    streamer = index.gpu_tier.streamer
    res.doc["slo_rate_stream"]["streamed_gb"] = streamer.num_bytes / 1e9
    index.drop_gpu_tier()
    if cpu and got:
        res.doc["slo_rate_stream_ratio"] = got / cpu


def _bracket(model: Any, args: Any) -> tuple[float, float]:
    """CPU-only bisection bracket from the model: a batch of ``max_batch`` back to back."""
    b = args.max_batch
    peak = b / max(model.cpu_seconds(b), 1e-9)
    return peak * 0.3, peak * 1.2
