"""``bench/overhead.py``'s figures: a side's per-node orchestration, scheduler work and phases
(``summarize``), the rounds' paired comparison with its sign test (``compare_rounds``) and the
printed table (``report``).
"""

from __future__ import annotations

import math
import statistics


def compare_rounds(result: dict) -> None:
    """Medians of the rounds and the paired (same round) after / before ratios, with the
    sign test's one-sided p of "at least this many of n rounds at most half" if the paired
    ratio's median were 0.5."""
    rounds = result["rounds"]
    med = {s: 1e3 * statistics.median(r["scheduler_s_per_node"] for r in rows)
           for s, rows in rounds.items()}  # fmt: skip
    paired = [a["scheduler_s_per_node"] / b["scheduler_s_per_node"]
              for a, b in zip(rounds["after"], rounds["before"], strict=True)]  # fmt: skip
    n, k = len(paired), sum(r <= 0.5 for r in paired)
    result["median_ms_per_node"] = med
    result["after_over_before"] = med["after"] / med["before"]
    result["paired_ratios"] = paired
    result["rounds_at_most_half"] = k
    result["sign_test_p"] = sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n
    print(f"scheduler work per node, median of {n} rounds of {result['concurrent']} concurrent "
          f"{result['workflow']} requests: before {med['before']:.3f} ms, after "
          f"{med['after']:.3f} ms, after/before {result['after_over_before']:.2f}; paired ratio "
          f"<= 0.5 in {k} of {n} rounds (sign test p {result['sign_test_p']:.3f})",
          flush=True)  # fmt: skip


def summarize(side: dict) -> dict:
    served = side["served"]
    e2e = sum(r["e2e"] for r in served)
    nodes = sum(r["nodes"] for r in served)
    orchestration = [r["e2e"] - r["model"] for r in served]
    model = [r["model"] for r in served]
    n, share = len(served), sum(orchestration) / e2e
    # the ratio of sums' standard error (delta method over the questions)
    residuals = [o - share * r["e2e"] for o, r in zip(orchestration, served, strict=True)]
    se = (sum(d * d for d in residuals) / (n * (n - 1))) ** 0.5 * n / e2e if n > 1 else None
    return {
        "src": side["src"],
        "e2e_s_mean": e2e / len(served),
        "model_s_mean": sum(model) / len(model),
        "orchestration_ms_per_node": 1e3 * sum(orchestration) / nodes,
        "orchestration_ms_per_node_median": 1e3
        * statistics.median(orchestration)
        * len(served)
        / nodes,
        "orchestration_share": share,
        "orchestration_share_se": se,
        "num_questions": n,
        "scheduler_ms_per_node": 1e3 * sum(r["scheduler"] for r in served) / nodes,
        "data_plane_us": side["data_plane_us"],
        "phases_ms_per_node": {
            k: 1e3 * sum(r["phases"][k] for r in served) / nodes for k in served[0]["phases"]
        }
        if "phases" in served[0]
        else None,
        "calls_per_node": {
            k: sum(r["calls"].get(k, 0) for r in served) / nodes
            for k in ("gen_send", "sched_receive", "sched_work", "engine_stats")
        }
        if "calls" in served[0]
        else None,
    }


def report(result: dict) -> str:
    lines = [f"preset {result['preset']}, {result['num']} oneshot questions per side, "
             f"before = {result['before']}, {result['wall_s']:.0f} s",
             "| side | e2e mean s | model mean s | orchestration ms/node (median) "
             "| orchestration share | scheduler work ms/node | message us: generation "
             "/ retrieval |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for side, r in result["sides"].items():
        lines.append(
            f"| {side} | {r['e2e_s_mean']:.3f} | {r['model_s_mean']:.3f} | "
            f"{r['orchestration_ms_per_node']:.2f} ({r['orchestration_ms_per_node_median']:.2f})"
            f" | {100 * r['orchestration_share']:.1f} % | {r['scheduler_ms_per_node']:.2f} | "
            f"{r['data_plane_us']['generation']:.0f} / {r['data_plane_us']['retrieval']:.0f} |"
        )
    for side, r in result["sides"].items():
        if r.get("orchestration_share_se") is not None:
            lines.append(f"{side}: orchestration share {100 * r['orchestration_share']:.2f} % "
                         f"+- {100 * r['orchestration_share_se']:.2f} % (1 s.e., "
                         f"{r['num_questions']} questions)")  # fmt: skip
    phases = {side: r["phases_ms_per_node"] for side, r in result["sides"].items()
              if r.get("phases_ms_per_node")}  # fmt: skip
    if phases:
        lines += ["where a node's time goes (ms per node; model = forward + sampling, "
                  "embedding, scan; transit = no traced work: pipes, queues, wake-ups):",
                  "| phase | " + " | ".join(phases) + " |",
                  "| --- |" + " --- |" * len(phases)]  # fmt: skip
        for k in next(iter(phases.values())):
            lines.append(f"| {k} | " + " | ".join(f"{p[k]:.3f}" for p in phases.values()) + " |")
    for side, r in result["sides"].items():
        if r.get("calls_per_node"):
            calls = ", ".join(f"{k} {v:.1f}" for k, v in r["calls_per_node"].items())
            lines.append(f"{side}: calls per node: {calls} (sched_work = scheduler cycles)")
    return "\n".join(lines)
