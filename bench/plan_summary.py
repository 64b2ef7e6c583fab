"""One line per part of a ``bench/h200_plan.sh`` call, read from the part's results folder:
what decides the part's targets, or why there is nothing to read.

    python bench/plan_summary.py overhead $OUT/overhead
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def overhead(d: Path) -> str:
    doc = json.loads((d / "overhead_compact.json").read_text())
    parts = []
    if "sides" in doc:
        s = {k: doc["sides"][k] for k in ("before", "after")}
        parts.append(
            f"orchestration share after {100 * s['after']['orchestration_share']:.2f} % "
            f"+- {100 * (s['after']['orchestration_share_se'] or 0):.2f} (target <= 2 %), "
            f"before {100 * s['before']['orchestration_share']:.2f} % "
            f"({s['after']['num_questions']} questions a side, answers agree "
            f"{doc.get('answers_agreement', 1.0):.2f})"
        )
    else:
        parts.append(f"no sequential result ({doc.get('sequential_asked', 0)} asked)")
    if "after_over_before" in doc:
        med = doc["median_ms_per_node"]
        n = len(doc["paired_ratios"])
        parts.append(
            f"scheduler ms/node before {med['before']:.3f}, after {med['after']:.3f}, "
            f"after/before {doc['after_over_before']:.2f} (target <= 0.5; paired <= 0.5 in "
            f"{doc['rounds_at_most_half']} of {n} rounds, sign test p {doc['sign_test_p']:.3f})"
        )
    else:
        parts.append("no round finished")
    return "; ".join(parts + ([doc["stopped"]] if "stopped" in doc else []))


def kv_tiers(d: Path) -> str:
    doc = json.loads((d / "kv_tiers_compact.json").read_text())
    rows = [_kv_row(name, r) for name, r in doc["configs"].items()]
    best = doc["configs"].get("tree_host_pgdsf_aware", {})
    ratios = ", ".join(
        f"{k.replace('_vs_', ' vs ')} {best[k]:.2f}x"
        for k in ("ttft_speedup_vs_no_reuse", "throughput_ratio_vs_no_reuse",
                  "ttft_speedup_vs_block_cache", "throughput_ratio_vs_block_cache")
        if k in best
    )  # fmt: skip
    return f"tree_host_pgdsf_aware: {ratios or 'no ratios'} | " + "; ".join(rows)


def _kv_row(name: str, r: dict) -> str:
    if "skipped" in r or "prefill_tokens" not in r:
        return f"{name} {'skipped' if 'skipped' in r else 'failed'}"
    thr, ttft = r.get("throughput_rps"), r.get("mean_ttft_s")
    return (
        f"{name} capacity {'-' if thr is None else f'{thr:.2f}'} req/s, ttft "
        f"{'-' if ttft is None else f'{ttft:.3f}'} s, prefill {r['prefill_tokens']}, "
        f"agree {r['agreement']:.2f}{' (cut)' if 'error' in r else ''}"
    )


def kv_capacity(d: Path) -> str:
    """Issue 12's deciding figures: TTFT and capacity ratios of the tree with host tier and
    cache-aware admission vs no reuse and the block cache, with the capacity ratio's interval
    from the two brackets; per configuration its bracket, TTFT and agreement; the control."""
    doc = json.loads((d / "kv_capacity.json").read_text())
    rows = doc["configs"]
    tree = rows.get("tree_host_pgdsf_aware", {})
    parts = []
    for ref, target_ttft, target_cap in (("no_reuse", 4.0, 2.0), ("block_cache", 1.5, 1.5)):
        r = rows.get(ref, {})
        text = f"vs {ref}:"
        if r.get("mean_ttft_s") and tree.get("mean_ttft_s"):
            text += f" ttft {r['mean_ttft_s'] / tree['mean_ttft_s']:.2f}x (target >= {target_ttft})"
        lo, hi = _ratio_interval(tree.get("capacity"), r.get("capacity"))
        if lo is not None:
            text += f" capacity {_fmt_interval(lo, hi)} (target >= {target_cap})"
        parts.append(text if text.endswith(")") else f"{text} -")
    control = rows.get("no_reuse", {}).get("control")
    parts.append(f"control agreement {control['agreement']:.2f}" if control else "no control")
    return "; ".join(parts) + " | " + "; ".join(_cap_row(n, r) for n, r in rows.items())


def _bracket(cap: dict | None) -> tuple[float, float] | None:
    """[low, high) of a capacity search (``kv_capacity.search_capacity``), None if unknown."""
    if not cap or (cap.get("rate") is None and cap.get("upper") is None):
        return None
    return cap.get("rate") or 0.0, cap.get("upper") or float("inf")


def _ratio_interval(num: dict | None, den: dict | None) -> tuple[float | None, float | None]:
    a, b = _bracket(num), _bracket(den)
    if a is None or b is None or b[0] == 0.0:
        return None, None
    return a[0] / b[1], a[1] / b[0]


def _fmt_interval(lo: float, hi: float) -> str:
    if hi == float("inf"):
        return f">= {lo:.2f}x" if lo > 0 else "undetermined (both brackets open)"
    return f"{lo:.2f}-{hi:.2f}x" if lo > 0 else f"< {hi:.2f}x"


def _cap_row(name: str, r: dict) -> str:
    if "skipped" in r or "agreement" not in r:
        return f"{name} {'skipped' if 'skipped' in r else 'failed'}"
    cap, ttft = r.get("capacity"), r.get("mean_ttft_s")
    span = _bracket(cap)
    if span is None:
        text = "capacity -"
    else:
        hi = "inf" if span[1] == float("inf") else f"{span[1]:.2f}"
        text = f"capacity [{span[0]:.2f}, {hi}) req/s ({cap['bound']}, {len(cap['points'])} probes)"
    if ttft is not None:
        text += f", ttft {ttft:.3f} s (p90 {r['p90_ttft_s']:.3f})"
    return f"{name} {text}, agree {r['agreement']:.2f}{' (cut)' if 'error' in r else ''}"


def overflow_stream(d: Path) -> str:
    doc = json.loads((d / "overflow_stream.json").read_text())
    caps, parts = {}, []
    for system in ("cpu", "tier", "stream"):
        rate = doc.get(f"slo_rate_{system}") or {}
        keys = ("capacity_qps", "bound", "first_unsustained_qps")
        cap, bound, upper = (rate.get(k) for k in keys)
        caps[system] = (cap, bound or "-")
        text = f"{system} {bound or '-'}" + (f" {cap:.1f} q/s" if cap is not None else "")
        if upper is not None and bound != "=":
            text += f" (< {upper:.1f})" if cap is not None else f" {upper:.1f} q/s"
        if not rate and doc.get(f"rate_points_{system}"):
            text += f" (cut after {len(doc[f'rate_points_{system}'])} points)"
        parts.append(text)
    text = ", ".join(parts)
    cpu, stream = caps["cpu"][0], caps["stream"][0]
    if cpu and stream:
        bounds = f"{caps['stream'][1]} / {caps['cpu'][1]}"
        text += f"; stream / cpu {stream / cpu:.2f}x (bounds {bounds}; target >= 3)"
    errors = [
        f"{p['system']} {100 * p['p90_error']:+.0f} %"
        for p in doc.get("points", [])
        if str(p.get("system", "")).startswith("gpu_tier") and "p90_error" in p
    ]
    text += f"; p90 model error {', '.join(errors) or '-'} (target within 15 %)"
    return text + f"; failures {len(doc.get('failures', []))}"


def cpu_scan(d: Path) -> str:
    """q/s (p90) of each CPU-only point by batch; the parallel / one-thread ratio of ragserve's
    scan; ids against the first scan setting."""
    doc = json.loads((d / "cpu_scan.json").read_text())
    rows, qps = [], {}
    for p in doc["points"]:
        name = f"{p['system']}" + (f"@{p['scan_threads']}" if "scan_threads" in p else "")
        qps[name, p["batch"]] = p["qps"]
        rows.append(
            f"{name} b{p['batch']} {p['qps']:.1f} q/s ({1e3 * p['p90_s']:.0f} ms, "
            f"ids {p['exact_ids']:.2f})"
        )
    one = {b: v for (n, b), v in qps.items() if n == "cpu_faiss@1"}
    many = {b: v for (n, b), v in qps.items() if n.startswith("cpu_faiss@") and n != "cpu_faiss@1"}
    ratios = [f"b{b} {many[b] / one[b]:.2f}x" for b in sorted(one) if b in many]
    return f"parallel / one-thread {', '.join(ratios) or '-'} | " + "; ".join(rows)


def gpu_tests(d: Path) -> str:
    lines = (d / "gpu_tests.log").read_text().strip().splitlines()
    return lines[-1] if lines else "empty log"


PARTS = {"overhead": overhead, "kv_tiers": kv_tiers, "overflow_stream": overflow_stream,
         "gpu_tests": gpu_tests, "kv_capacity": kv_capacity, "cpu_scan": cpu_scan}  # fmt: skip


def main(argv: list[str]) -> None:
    part, folder = argv
    try:
        line = PARTS[part](Path(folder))
    except FileNotFoundError as exc:
        line = f"no result ({Path(exc.filename).name} missing; see {folder}/part.log)"
    except (KeyError, TypeError, ValueError) as exc:
        line = f"unreadable result ({type(exc).__name__}: {exc})"
    print(f"{part}: {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
