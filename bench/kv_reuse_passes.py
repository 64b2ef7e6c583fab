"""The KV-reuse bench's passes over one engine: all-at-once replays and sustained-load probes.

- **replay**: requests all at once; outputs, TTFT, all-at-once throughput and prompt tokens
  computed (admitted prompt tokens minus cache hits, recomputation after preemption
  included: ``prefill_tokens``, the machine-independent measure of reuse).
- **control replay**: the cold replay's requests again in a shuffled arrival order: the
  noise floor of ``agreement`` (1.0 in exact arithmetic).
- **sustained** (``bench/kv_capacity.py``'s method): a probe offers Poisson arrivals at a
  rate from the same Zipf popularity: ``--warmup-s`` worth of warm-up arrivals, then
  ``--window-requests`` counted ones; the window's arrivals unfinished ``--drain-s`` after the
  last arrival are aborted (misses). Sustained iff >= 95 % of the window's arrivals complete
  (completed >= 95 % of offered), >= 90 % within ``--slo`` s, and their latency grows by at
  most ``--max-latency-growth`` s per s of arrivals (no queue building up: the overload a
  short window hides from the SLO). First the TTFT probe (``--ttft-requests`` counted
  arrivals) at the **common rate**, ``--rate`` or ``--load`` x the first configuration's
  all-at-once throughput, the same for every configuration (mean / p90 TTFT over its
  window). Then, for ``--capacity-configs``, the capacity search: from ``--capacity-guess`` x
  this configuration's all-at-once throughput (warm replay), steps of ``1 + --rel-tol`` that
  grow while the verdict holds, then bisection to within ``1 + --rel-tol``; at most
  ``--max-probes`` probes, and none that would end past the time budget less ``--reserve-s``
  per configuration still to run. ``capacity.bound`` says what was found: "=" bracketed
  within the tolerance, "~" bracketed wider, ">=" / "<" one-sided.

A pass still running at the run's deadline raises ``PassTimeout``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from kv_capacity import arrival_window_stats, keeps_up, probe_offsets, search_capacity
from ragserve.generation import LLMEngine

log = logging.getLogger("bench_kv_reuse")


class PassTimeout(Exception):
    """A pass ran past the run's time budget."""


@dataclass(frozen=True)
class Response:
    """One request of a pass as ``kv_capacity.arrival_window_stats`` reads it (monotonic s)."""

    error: str | None
    finish_time: float
    latency: float
    ttft: float | None


def drive(engine: LLMEngine, requests, params, offsets, deadline, drain_s=None) -> dict:
    """Run ``requests`` ((ids, ends) each) arriving ``offsets[i]`` s after the start; latency
    and TTFT count from the nominal arrival. With ``drain_s`` requests unfinished that long
    after the last arrival are aborted (``error``). Returns responses, outputs, seconds."""
    start = time.monotonic()
    order = sorted(range(len(requests)), key=lambda i: offsets[i], reverse=True)
    first, outputs, finished = {}, {}, {}
    last_log = start
    cutoff = None if drain_s is None else start + max(offsets) + drain_s
    while order or engine.has_unfinished():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise PassTimeout(f"stopped at the time budget after {len(outputs)} requests")
        if cutoff is not None and now > cutoff and not order:
            for i in range(len(requests)):
                if i not in outputs:
                    engine.abort(str(i))
            break
        if now - last_log > 10.0:
            log.info("  ... %d/%d done, %d started", len(outputs), len(requests), len(first))
            last_log = now
        while order and offsets[order[-1]] <= now - start:
            i = order.pop()
            ids, ends = requests[i]
            engine.add_request(str(i), ids, params, segment_ends=ends)
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(offsets[order[-1]] - (now - start), 0.0)))
            continue
        for out in engine.step():
            i = int(out.request_id)
            if i not in first and out.token_ids:
                first[i] = out.metrics.first_token_time
            if out.finished:
                outputs[i] = out.token_ids
                finished[i] = (out.metrics.finish_time, out.finish_reason)
    seconds = time.monotonic() - start
    responses = []
    for i in range(len(requests)):
        arrival = start + offsets[i]
        fin, reason = finished.get(i, (None, "abort"))
        ok = fin is not None and reason in ("length", "stop")
        responses.append(
            Response(
                None if ok else f"finish reason {reason}",
                fin if fin is not None else float("inf"),
                fin - arrival if fin is not None else float("inf"),
                first[i] - arrival if i in first else None,
            )
        )
    return {"responses": responses, "outputs": outputs, "seconds": seconds, "start": start}


def replay(engine: LLMEngine, workload, params, deadline) -> dict:
    """All requests at once: outputs, TTFT, all-at-once throughput, prompt tokens computed."""
    sched = engine.scheduler
    hit0, query0 = sched.prefix_cache_hit_tokens, sched.prefix_cache_query_tokens
    requests = [(ids, ends) for ids, ends, _ in workload]
    run = drive(engine, requests, params, [0.0] * len(requests), deadline)
    t = np.asarray([r.ttft for r in run["responses"]])
    return {
        "mean_ttft_s": float(t.mean()),
        "p90_ttft_s": float(np.percentile(t, 90)),
        "seconds": run["seconds"],
        "requests_per_s": len(workload) / run["seconds"],
        "prefill_tokens": (sched.prefix_cache_query_tokens - query0)
        - (sched.prefix_cache_hit_tokens - hit0),
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "outputs": [run["outputs"][i] for i in range(len(workload))],
    }


def probe(engine, corpus, a, params, rate: float, num_window: int, deadline) -> dict:
    """One sustained-load point at ``rate`` req/s (``kv_capacity``'s module doc): a warm-up of
    ``--warmup-s`` worth of arrivals, then ``num_window`` counted ones, drawn from the corpus's
    Zipf popularity (seeded by the rate: every configuration gets the same requests at the
    same rate). Window statistics, sustained or not, and the window's TTFT."""
    rng = np.random.default_rng([a.seed, int(rate * 1000)])
    num_warmup = max(math.ceil(rate * a.warmup_s), 1)
    offsets = probe_offsets(rng, rate, num_warmup, num_window)
    requests = [corpus.request(rng, a) for _ in offsets]
    run = drive(engine, requests, params, offsets, deadline, drain_s=a.drain_s)
    stats = arrival_window_stats(run["responses"], offsets, num_warmup, a.slo)
    measured = [r.ttft for r in run["responses"][num_warmup:] if r.ttft is not None]
    stats |= {
        "rate": rate,
        "warmup_requests": num_warmup,
        "mean_ttft_s": float(np.mean(measured)) if measured else None,
        "p90_ttft_s": float(np.percentile(measured, 90)) if measured else None,
        "seconds": run["seconds"],
    }
    stats["sustained"] = keeps_up(stats, a.max_latency_growth)
    log.info("  probe %.2f req/s: %s", rate, {k: rounded(v) for k, v in stats.items()})
    return stats


def rounded(v):
    return round(v, 3) if isinstance(v, float) else v


def probe_seconds(a: argparse.Namespace, rate: float, num_window: int) -> float:
    """A probe's longest wall time: its arrivals, then the whole drain."""
    return (max(math.ceil(rate * a.warmup_s), 1) + num_window) / rate + a.drain_s


def sustained_passes(name, engine, corpus, a, params, estimate, deadline, state) -> dict:
    """The TTFT probe at the common rate (``--rate``, or ``--load`` x the first
    configuration's all-at-once throughput), then, for ``--capacity-configs``, the capacity
    search from ``--capacity-guess`` x ``estimate`` (this configuration's all-at-once
    throughput). A probe that would end past the search's deadline (the budget less
    ``--reserve-s`` per configuration still to run) is not started: the bound says so."""
    if state.get("rate") is None:
        state["rate"] = a.rate or a.load * estimate
    paced = probe(engine, corpus, a, params, state["rate"], a.ttft_requests, deadline)
    row: dict = {
        "mean_ttft_s": paced["mean_ttft_s"],
        "p90_ttft_s": paced["p90_ttft_s"],
        "rate_rps": state["rate"],
        "paced": paced,
        "throughput_rps": None,
        "throughput_method": "not searched (--capacity-configs)",
    }
    if name not in a.capacity_configs:
        return row
    later = state["names"][state["names"].index(name) + 1 :]
    search_end = None if deadline is None else deadline - a.reserve_s * len(later)

    def fits(rate: float) -> bool:
        ends = time.monotonic() + probe_seconds(a, rate, a.window_requests)
        return search_end is None or ends <= search_end

    cap = search_capacity(
        lambda r: probe(engine, corpus, a, params, r, a.window_requests, deadline),
        a.capacity_guess * estimate,
        rel_tol=a.rel_tol,
        max_probes=a.max_probes,
        fits=fits,
        judge=lambda stats: keeps_up(stats, a.max_latency_growth),
    )
    return row | {
        "throughput_rps": cap["rate"],
        "throughput_method": f"sustained ({cap['bound']})",
        "capacity": cap,
    }


def agreement(outputs: list[list[int]], base: list[list[int]]) -> float:
    """Share of requests whose generated tokens equal the baseline's."""
    return sum(o == b for o, b in zip(outputs, base, strict=True)) / len(base)


def logged_replay(what: str, rep: dict) -> dict:
    log.info("  %s: %.3f req/s, %d of %d prompt tokens computed", what,
             rep["requests_per_s"], rep["prefill_tokens"], rep["prompt_tokens"])  # fmt: skip
    return rep


def control_replay(engine, workload, params, deadline, outputs: list[list[int]]) -> dict:
    """The noise floor of ``agreement``: the cold replay's requests again in the same engine,
    in another (seeded, shuffled) arrival order, so prefill chunks and batches are composed
    differently; the share of requests whose tokens equal the first pass's. Exact arithmetic
    gives 1.0; bf16 with near-tied logits (random weights) gives less without any KV reused."""
    order = np.random.default_rng(12).permutation(len(workload)).tolist()
    rep = logged_replay("control replay", replay(engine, [workload[i] for i in order], params,
                                           deadline))  # fmt: skip
    again = [None] * len(workload)
    for pos, i in enumerate(order):
        again[i] = rep["outputs"][pos]
    return {"agreement": agreement(again, outputs), "order_seed": 12,
            "requests_per_s": rep["requests_per_s"]}  # fmt: skip
