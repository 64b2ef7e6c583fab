"""Metrics of one benchmark point and the latency-vs-rate plots."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

SLO_TARGET = 0.9  # "throughput at SLO": the highest rate at which this share met the SLO


def summarize(responses: list, *, slo: float, wall: float) -> dict:
    """Mean/p90 end-to-end latency and TTFT of the completed requests, throughput, SLO
    attainment over ALL requests (failed and timed-out ones count as misses), errors."""
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
        "num_timed_out": sum(r.error == "aborted" for r in responses),
        "errors": sorted({r.error for r in responses if r.error is not None})[:3],
        "latency_mean_s": float(np.mean(lat)),
        "latency_p90_s": float(np.percentile(lat, 90)),
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "throughput_rps": len(ok) / span if span > 0 else None,
        "slo_attainment": sum(r.latency <= slo for r in ok) / max(len(responses), 1),
        "span_s": span,
    }


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per (workflow, nprobe): mean latency vs request rate, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "skipped" not in r and "capacity_rps" not in r:  # capacity rows have no rate
            groups[(r["workflow"], r["nprobe"])][r["system"]].append(
                (r["rate"], r["latency_mean_s"])
            )
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
    lines = [*slo_table(rows, baseline), ""]
    rows = [r for r in rows if "skipped" not in r]
    for wf, nprobe in sorted({(r["workflow"], r["nprobe"]) for r in rows}):
        sub = [r for r in rows if r["workflow"] == wf and r["nprobe"] == nprobe]
        lines += [f"**{wf}** (nprobe {nprobe})", ""]
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


def throughput_at_slo(rows: list[dict], target: float = SLO_TARGET) -> dict[tuple, float]:
    """(workflow, nprobe, system) -> the highest measured rate whose SLO attainment reached
    ``target`` with every lower measured rate also reaching it (0.0: not even the lowest)."""
    out: dict[tuple, float] = {}
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["workflow"], r["nprobe"], r["system"])].append(r)
    for key, sub in groups.items():
        best = 0.0
        for r in sorted(sub, key=lambda r: r["rate"]):
            if "skipped" in r or r["slo_attainment"] < target:
                break
            best = r["rate"]
        out[key] = best
    return out


def slo_table(rows: list[dict], baseline: str = "sequential") -> list[str]:
    """Throughput at SLO per system and its ratio to ``baseline`` and to ``stagewise``."""
    tput = throughput_at_slo(rows)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    out = [
        f"Throughput at SLO (highest swept rate with >= {SLO_TARGET:.0%} of requests within "
        "the SLO, `>=` when that is the highest rate swept; ratio vs `sequential` / vs "
        "`stagewise` in brackets):",
        "",
        "| workflow | nprobe | " + " | ".join(systems) + " |",
        "| --- | --- |" + " --- |" * len(systems),
    ]
    for wf, nprobe in sorted({(r["workflow"], r["nprobe"]) for r in rows}):
        cells = []
        for s in systems:
            x = tput.get((wf, nprobe, s))
            if x is None:
                cells.append("-")
                continue
            ratios = []
            for b in (baseline, "stagewise"):
                y = tput.get((wf, nprobe, b))
                ratios.append("-" if not y else f"{x / y:.1f}x")
            top = x == max(r["rate"] for r in rows if (r["workflow"], r["nprobe"]) == (wf, nprobe))
            cells.append(f"{'>=' if top else ''}{x:g} ({' / '.join(ratios)})")
        out.append(f"| {wf} | {nprobe} | " + " | ".join(cells) + " |")
    return out


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
