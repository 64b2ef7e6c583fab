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


def markdown(rows: list[dict], baseline: str = "sequential") -> str:
    """Tables per workflow: each system's metrics per rate, and mean-latency ratios."""
    lines = []
    for wf in sorted({r["workflow"] for r in rows}):
        sub = [r for r in rows if r["workflow"] == wf]
        lines += [f"**{wf}** (nprobe {sub[0]['nprobe']})", ""]
        lines += [
            "| rate (req/s) | system | mean / p90 latency (s) | mean TTFT (s) | throughput "
            "(req/s) | SLO met | spec. accuracy | sched. ms/node |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sorted(sub, key=lambda r: (r["rate"], r["system"])):
            acc = "" if r["spec_accuracy"] is None else f"{r['spec_accuracy']:.2f}"
            lines.append(
                f"| {r['rate']:g} | {r['system']} | {r['latency_mean_s']:.2f} / "
                f"{r['latency_p90_s']:.2f} | {r['ttft_mean_s']:.2f} | "
                f"{r['throughput_rps']:.2f} | {r['slo_attainment']:.0%} | {acc} | "
                f"{r.get('scheduler_ms_per_node', float('nan')):.2f} |"
            )
        lines.append("")
        lines += _ratios(sub, baseline)
    return "\n".join(lines)


def _ratios(sub: list[dict], baseline: str) -> list[str]:
    by = {(r["system"], r["rate"]): r for r in sub}
    systems = [s for s in dict.fromkeys(r["system"] for r in sub) if s != baseline]
    rates = sorted({r["rate"] for r in sub})
    out = [
        f"Mean latency of `{baseline}` / mean latency of each system (higher = faster):",
        "",
        "| system | " + " | ".join(f"{x:g} req/s" for x in rates) + " |",
        "| --- |" + " --- |" * len(rates),
    ]
    for s in systems:
        cells = []
        for x in rates:
            a, b = by.get((baseline, x)), by.get((s, x))
            ok = a and b and b["latency_mean_s"] > 0
            cells.append(f"{a['latency_mean_s'] / b['latency_mean_s']:.2f}x" if ok else "-")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return [*out, ""]


if __name__ == "__main__":
    import json
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())["rows"]))
