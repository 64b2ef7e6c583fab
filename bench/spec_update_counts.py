"""Generation update messages per node with speculation on, update coalescing on vs off.

The CPU twin of the overhead bench never speculates (its retrievals are not split), while
the H200 run does; this probe forces speculation on the twin's data (tiny CPU model,
synthetic index: ``bench/rag_setup.py``) with ``CoScheduleConfig(spec_first_clusters=1)``
and counts, for sequential oneshot questions, the generation updates the engine side
produced (``GenerationRunner.num_updates``: one update = one results message in process
mode) and the scheduler cycles, per node, in one in-process server per setting (in process a
cycle runs one engine step, so cycles follow the steps, not the updates). Both
settings must answer identically (the run fails otherwise).

    python bench/spec_update_counts.py --data /tmp/s5dev/data --num 6 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_side import OVERHEAD_PRESETS  # noqa: E402
from rag_setup import prepare  # noqa: E402


def run(data: dict, coalescing: bool, questions: list[str], preset) -> dict:
    from ragserve import Server
    from ragserve.runtime.config import ServerConfig
    from ragserve.scheduler.cosched import CoScheduleConfig
    from ragserve.workflows import get_workflow

    cosched = CoScheduleConfig(spec_first_clusters=1, spec_capacity=1000)
    config = ServerConfig(
        in_process=True,
        engine_kwargs=tuple(dict(data["engine_kwargs"]).items()),
        default_nprobe=data["nprobe"],
        cosched=cosched,
        enable_update_coalescing=coalescing,
    )
    with Server(model=data["model"], index=data["index"], config=config) as server:
        spec = next(t for t in server.scheduler.transforms if hasattr(t, "stats"))
        graph = get_workflow("oneshot", topk=preset.topk, max_tokens=preset.max_tokens)
        answers = [server.run(q, graph).output for q in questions]
        stats = server.stats()
        nodes = stats["num_node_runs"]
        return {
            "coalescing": coalescing,
            "answers": answers,
            "nodes": nodes,
            "updates_per_node": server.executor.generation.num_updates / nodes,
            "cycles_per_node": stats["num_cycles"] / nodes,
            "speculations_started": spec.stats.num_started,
            "speculations_adopted": spec.stats.num_adopted,
        }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--num", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    preset = OVERHEAD_PRESETS["cpu"]  # the overhead bench's (its num_requests unused here)
    data = prepare(preset, "synthetic", args.data)
    questions = data["questions"][: args.num]
    off, on = run(data, False, questions, preset), run(data, True, questions, preset)
    if off["answers"] != on["answers"]:
        raise SystemExit("coalescing changed an answer")
    result = {"num": args.num, "off": off, "on": on}
    for r in (off, on):
        print(
            f"coalescing {'on ' if r['coalescing'] else 'off'}: "
            f"{r['updates_per_node']:.2f} generation updates per node, "
            f"{r['cycles_per_node']:.2f} scheduler cycles per node, speculations started "
            f"{r['speculations_started']}, adopted {r['speculations_adopted']}"
        )
    print("answers identical")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
