"""Metrics of one benchmark point and the latency-vs-rate plots."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np


def summarize(responses: list, *, slo: float, wall: float) -> dict:
    """Mean/p90 end-to-end latency and TTFT, throughput, SLO attainment, errors."""
    ok = [r for r in responses if r.error is None]
    lat = np.array([r.latency for r in ok]) if ok else np.array([np.nan])
    ttft = np.array([r.ttft for r in ok if r.ttft is not None] or [np.nan])
    if ok:
        first = min(r.arrival_time for r in responses)
        span = max(r.finish_time for r in ok) - first
    else:
        span = wall
    return {
        "num_requests": len(responses),
        "num_errors": len(responses) - len(ok),
        "errors": sorted({r.error for r in responses if r.error is not None})[:3],
        "latency_mean_s": float(np.mean(lat)),
        "latency_p90_s": float(np.percentile(lat, 90)),
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "throughput_rps": len(ok) / span if span > 0 else None,
        "slo_attainment": float(np.mean([r.latency <= slo for r in ok])) if ok else 0.0,
        "span_s": span,
    }


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per (workflow, nprobe): mean latency vs request rate, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r["workflow"], r["nprobe"])][r["system"]].append((r["rate"], r["latency_mean_s"]))
    paths = []
    for (wf, nprobe), systems in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for system, pts in systems.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean end-to-end latency (s)")
        ax.set_title(f"{wf}, nprobe {nprobe}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"latency_{wf}_nprobe{nprobe}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
