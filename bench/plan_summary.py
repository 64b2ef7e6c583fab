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
        if p.get("system") in ("gpu_tier", "gpu_tier_stream") and "p90_error" in p
    ]
    text += f"; p90 model error {', '.join(errors) or '-'} (target within 15 %)"
    return text + f"; failures {len(doc.get('failures', []))}"


def gpu_tests(d: Path) -> str:
    lines = (d / "gpu_tests.log").read_text().strip().splitlines()
    return lines[-1] if lines else "empty log"


PARTS = {"overhead": overhead, "kv_tiers": kv_tiers, "overflow_stream": overflow_stream,
         "gpu_tests": gpu_tests}  # fmt: skip


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
