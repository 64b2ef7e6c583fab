"""Scale-out benchmark: sustained RAG capacity with N LLM replicas x M index shards on Ray.

For each configuration ``RxS`` (replicas x shards) one Ray-backed ``Server`` runs the same
workload (``rag_bench``'s presets, questions and Poisson arrivals) and its sustained capacity
is bisected with the method every RAG figure uses (``sustained.py``): each probed rate offers
``--warmup`` + ``--window`` seconds of arrivals, only the window counts, sustained = completed
>= 95 % of the offered rate and >= 90 % within the SLO; geometric bisection inside the
configuration's bracket (``--capacity``) until it is ``--rel-tol`` wide. The warm-up defaults
to the SLO: completions are counted inside the window, so a request that arrived before the
window's start and finished inside it stands in for one that arrived near its end and
finishes after it; with a warm-up shorter than the latency the first ones do not exist and the
window loses ``E[(latency - warmup)+] / window`` of its completions (a fill artefact, not a
capacity limit). A warm-up of at least the SLO makes that loss zero for every request that
meets the SLO. ``--tier-gb`` puts the index in GPU tiers
(``ServerConfig.gpu_tier``: split over the shards, each beside a replica on its GPU). Every
point is written to ``results.json`` as it is measured, so a run cut short keeps its data;
``--budget-s`` stops starting points that would not end in time. Ratios are against the first
configuration, measured in the same run on the same cluster.

    python bench/scale_bench.py --preset smoke --configs 1x1 2x1 --capacity 2:8 \\
        --warmup 1 --window 4 --min-window 1 --tier-gb 0.01 --tier-device cpu   # CPU twin
    python bench/scale_bench.py --preset h200 --configs 1x1 2x1 --nprobe 256 --rel-tol 0.03 \\
        --capacity 1x1:52:64 2x1:98:120 --max-points 5 --tier-gb 24 --ray-num-gpus 2 \\
        --out /root/scale/replicas --data /root/scale/data                    # 2 H200s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead_trace import time_scheduler  # noqa: E402
from rag_bench import arrivals, run_arrivals, workflow_graphs  # noqa: E402
from rag_report import summarize  # noqa: E402
from rag_setup import PRESETS, prepare  # noqa: E402
from rag_systems import SYSTEMS, system_transforms  # noqa: E402
from sustained import find_capacity, is_sustained, window_stats  # noqa: E402

logger = logging.getLogger("scale_bench")

START_ALLOWANCE_S = 90.0  # a configuration's start (actors, engines, tiers), for --budget-s


class OutOfTime(Exception):
    """The next point would end past ``--budget-s``."""


def parse_config(text: str) -> tuple[int, int]:
    """``"2x1"`` -> (2 replicas, 1 shard)."""
    try:
        replicas, shards = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a configuration is REPLICASxSHARDS like 2x1, got {text!r}") from None
    if replicas < 1 or shards < 1:
        raise ValueError(f"replicas and shards must be >= 1, got {text!r}")
    return replicas, shards


Brackets = dict[int | str | None, tuple[float, float]]


def parse_brackets(specs: list[str]) -> Brackets:
    """``["40:70", "2:70:140", "1x2:44:64"]`` -> {None: (40, 70), 2: (70, 140), "1x2": (44,
    64)}: ``LO:HI`` is one replica's bracket (R replicas: R x it), ``R:LO:HI`` the bracket for
    R replicas, ``RxS:LO:HI`` the bracket of configuration ``RxS``; a configuration's own
    bracket wins over its replica count's, which wins over one replica's."""
    out: Brackets = {}
    for spec in specs:
        parts = spec.split(":")
        try:
            if len(parts) == 2:
                key: int | str | None = None
            elif len(parts) == 3 and "x" in parts[0].lower():
                replicas, shards = parse_config(parts[0])
                key = f"{replicas}x{shards}"
            elif len(parts) == 3:
                key = int(parts[0])
            else:
                raise ValueError
            lo, hi = float(parts[-2]), float(parts[-1])
        except ValueError:
            raise ValueError(
                f"capacity: LO:HI, REPLICAS:LO:HI or RxS:LO:HI, got {spec!r}"
            ) from None
        if not 0 < lo < hi or (isinstance(key, int) and key < 1):
            raise ValueError(f"capacity: need 0 < LO < HI and REPLICAS >= 1, got {spec!r}")
        out[key] = (lo, hi)
    return out


def bracket(brackets: Brackets, config: str | int) -> tuple[float, float]:
    """The bisection bracket of configuration ``config`` (``"2x1"``; an int: R replicas)."""
    if isinstance(config, int):
        replicas, key = config, None
    else:
        replicas, shards = parse_config(config)
        key = f"{replicas}x{shards}"
    if key is not None and key in brackets:
        return brackets[key]
    if replicas in brackets:
        return brackets[replicas]
    if None not in brackets:
        raise ValueError(f"capacity: no bracket for {config!r} (give LO:HI, R:LO:HI or RxS:LO:HI)")
    lo, hi = brackets[None]
    return lo * replicas, hi * replicas


def start_server(replicas: int, shards: int, p, data: dict, args):
    from ragserve.runtime import Server, ServerConfig
    from ragserve.runtime.config import GpuTierConfig
    from ragserve.scheduler.cosched import CoScheduleConfig

    tier = None
    if args.tier_gb:
        budget = int(args.tier_gb * 1e9)
        tier = GpuTierConfig(budget_bytes=budget, device=args.tier_device, dtype=args.tier_dtype)
    config = ServerConfig(
        backend="ray",
        num_llm_replicas=replicas,
        num_index_shards=shards,
        ray_address=args.ray_address,
        shard_partition=args.partition,
        engine_kwargs=data["engine_kwargs"],
        default_nprobe=data["nprobe"],
        cosched=CoScheduleConfig.none(),
        gpu_tier=tier,
        max_active_requests=4096,
    )
    server = Server(data["model"], data["index"], config=config)
    chain = system_transforms(args.system, first_clusters=p.first_clusters)
    try:
        server.set_transforms(chain, timeout=60)
        warm_up(server, replicas, data["questions"], workflow_graphs(p)["oneshot"])
    except BaseException:
        server.close()
        raise
    return server, chain


def warm_up(
    server, replicas: int, questions: list[str], graph, max_rounds: int = 8, timeout: float = 120
) -> None:
    """Concurrent requests until every replica has run a task (not measured): a replica's
    first batch pays one-time costs (allocator, kernels) that must not land in a point. A
    round that does not finish within ``timeout`` seconds fails the configuration."""
    for k in range(max_rounds):
        batch = questions[-(k + 1) * 2 * replicas :][: 2 * replicas]

        async def go(batch=batch):
            jobs = asyncio.gather(*(server.submit(q, graph) for q in batch))
            return await asyncio.wait_for(jobs, timeout)

        try:
            asyncio.run(go())
        except TimeoutError:
            raise RuntimeError(f"warm-up: {len(batch)} requests not done in {timeout} s") from None
        workers = server.stats()["workers"]
        if all(workers[f"llm_{i}"].get("tasks", 0) > 0 for i in range(replicas)):
            return
    logger.warning("warm-up: some replica got no task in %d rounds", max_rounds)


def bench_config(cfg: str, p, data: dict, args, state: dict, entry: dict, on_point) -> None:
    """Capacity of one configuration into ``entry`` (filled as points are measured);
    ``state["offset"]`` hands out fresh questions."""
    replicas, shards = parse_config(cfg)
    lo, hi = bracket(args.brackets, cfg)
    entry.update(config=cfg, replicas=replicas, shards=shards, bracket=[lo, hi], points=[])
    points = entry["points"]
    if shards > 1:  # the shard folders, split on first use (reused by later runs): timed
        from ragserve.runtime.ray_backend import shard_root

        t0 = time.monotonic()
        shard_root(data["index"], shards, args.partition)
        entry["split_s"] = time.monotonic() - t0
        logger.info("%s: shard folders ready in %.1f s", cfg, entry["split_s"])
    t0 = time.monotonic()
    server, chain = start_server(replicas, shards, p, data, args)
    entry["start_s"] = time.monotonic() - t0
    entry["tier"] = {k: v for k, v in server.stats()["workers"].items() if "tier_bytes" in v}
    clock = time_scheduler(server)
    graphs = workflow_graphs(p, data["nprobe"])
    point_s = args.warmup + args.window + args.timeout + 5.0

    def one_rate(rate: float) -> dict:
        if time.monotonic() + point_s > args.deadline:
            raise OutOfTime(f"{cfg} at {rate:.1f} req/s would end past --budget-s")
        n = max(2, int(np.ceil(rate * (args.warmup + args.window))))
        times = arrivals(rate, n, args.seed)
        span = args.warmup + args.window
        times = times[times <= span] if (times <= span).sum() > 1 else times
        first = state["offset"]
        state["offset"] += len(times)
        qs = [data["questions"][(first + j) % len(data["questions"])] for j in range(len(times))]
        busy0 = clock["step"] - clock["poll"]
        t = time.monotonic()
        responses, start = asyncio.run(
            run_arrivals(server, graphs, [args.workflow] * len(times), qs, times, args.timeout)
        )
        stats = summarize(responses, slo=p.slo, wall=time.monotonic() - t)
        stats.update(window_stats(responses, times, start, args.warmup, p.slo), rate=rate)
        stats.update(fill_stats(responses, times, start, args.warmup))
        nodes = max(sum(len(r.node_timings) for r in responses), 1)
        stats["scheduler_ms_per_node"] = 1e3 * (clock["step"] - clock["poll"] - busy0) / nodes
        stats["sustained"] = is_sustained(stats)
        stats["workers"] = server.stats()["workers"]
        points.append(stats)
        logger.info("%s %s", cfg, json.dumps({k: v for k, v in stats.items() if k != "workers"}))
        on_point()
        return stats

    try:
        cap = find_capacity(one_rate, lo, hi, rel_tol=args.rel_tol, max_points=args.max_points)
        entry.update(capacity_rps=cap.rate, bound=cap.bound, upper_rps=cap.upper)
    except OutOfTime as exc:
        logger.warning("%s", exc)
        entry.update(from_points(points), cut_short=True)
    finally:
        server.close()


def fill_stats(responses: list, arrivals: np.ndarray, start: float, warmup: float) -> dict:
    """Diagnostics of a point's window (not part of the criterion), over the requests whose
    scheduled arrival ``start + arrivals[i]`` falls in it: ``window_done_share``, the share that
    completed OK (whenever, within the drain); ``fill_loss_share``, the expected share of the
    window's completions lost because the warm-up is shorter than a request's time from its
    scheduled arrival to its finish (``mean((finish - scheduled - warmup)+) / window``; 0 when
    the warm-up covers every one); ``submit_lag_mean_s`` / ``submit_lag_max_s``, the delay from
    the scheduled arrival to the submission (a client falling behind shifts completions past
    the window's end)."""
    rows = [(r, start + float(t)) for r, t in zip(responses, arrivals, strict=True) if t >= warmup]
    ok = [(r, due) for r, due in rows if r.error is None]
    span = float(arrivals[-1]) - warmup
    lost = sum(max(0.0, r.finish_time - due - warmup) for r, due in ok) / max(len(ok), 1)
    lags = [r.arrival_time - due for r, due in rows if r.arrival_time > 0]
    return {
        "window_done_share": len(ok) / max(len(rows), 1),
        "fill_loss_share": lost / span if span > 0 else None,
        "window_latency_max_s": max((r.latency for r, _ in ok), default=None),
        "submit_lag_mean_s": sum(lags) / len(lags) if lags else None,
        "submit_lag_max_s": max(lags, default=None),
    }


def from_points(points: list[dict]) -> dict:
    """Capacity, bound and upper of a bisection cut short, read off its measured points."""
    good = [pt["rate"] for pt in points if pt["sustained"]]
    bad = [pt["rate"] for pt in points if not pt["sustained"]]
    upper = min(bad, default=None)
    rate = max((r for r in good if upper is None or r < upper), default=None)
    bound = ">=" if upper is None else ("<" if rate is None else "=")
    return {"capacity_rps": rate, "bound": bound, "upper_rps": upper}


def summarize_configs(entries: list[dict]) -> dict:
    """Per configuration: capacity (``bound`` "=", ">=" or "<"), the first unsustained rate,
    scheduler ms per node (best point), and the ratio to the first configuration's capacity
    with the range the brackets allow (``ratio_range``: lowest, highest; None if unbounded)."""
    out = {}
    for e in entries:
        ms = [pt["scheduler_ms_per_node"] for pt in e["points"]]
        out[e["config"]] = {
            "capacity_rps": e.get("capacity_rps"),
            "bound": e.get("bound"),
            "upper_rps": e.get("upper_rps"),
            "scheduler_ms_per_node": min(ms) if ms else None,
        }
    if not entries:
        return out
    base = out[entries[0]["config"]]
    for entry in out.values():
        cap, up = entry["capacity_rps"], entry["upper_rps"]
        b_cap, b_up = base["capacity_rps"], base["upper_rps"]
        entry["ratio_vs_first"] = cap / b_cap if cap and b_cap else None
        low = cap / b_up if cap and b_up else None
        high = up / b_cap if up and b_cap else None
        entry["ratio_range"] = [low, high]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--dataset", choices=("synthetic", "factbook"), default="synthetic")
    ap.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2", "2x2"])
    ap.add_argument("--system", choices=SYSTEMS, default="ragserve")
    ap.add_argument("--workflow", choices=("oneshot", "hyde", "multistep", "irg", "recomp"),
                    default="oneshot")  # fmt: skip
    ap.add_argument("--nprobe", type=int, default=None, help="default: the preset's first")
    ap.add_argument("--capacity", nargs="+", required=True,
                    help="bisection brackets: LO:HI for one replica (x R for R replicas) "
                    "and/or R:LO:HI for R replicas")  # fmt: skip
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the window (default: the SLO; module doc)")  # fmt: skip
    ap.add_argument("--window", type=float, default=30.0, help="measured seconds per rate")
    ap.add_argument("--min-window", type=float, default=30.0,
                    help="shortest --window allowed (the method says 30 s)")  # fmt: skip
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="abort requests this long after the last arrival (default: the SLO)",
    )
    ap.add_argument("--max-points", type=int, default=4, help="rates per configuration")
    ap.add_argument("--rel-tol", type=float, default=0.15, help="bisection stops at hi/lo-1")
    ap.add_argument("--tier-gb", type=float, default=0.0,
                    help="GPU index tier over all shards (GB; 0: no tier)")  # fmt: skip
    ap.add_argument("--tier-device", default="cuda")
    ap.add_argument("--tier-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--partition", choices=("list", "document"), default="document")
    ap.add_argument("--ray-address", default=None, help="join this cluster (default: local)")
    ap.add_argument("--ray-num-cpus", type=int, default=None)
    ap.add_argument("--ray-num-gpus", type=int, default=None, help="default: Ray's detection")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration or point that would end after this many "
                    "seconds from the start")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale"))
    ap.add_argument(
        "--data",
        type=Path,
        default=None,
        help="model and index folder, made on first use (default: OUT/data)",
    )
    return ap


def check_args(args) -> None:
    """Bad input fails before the (slow) index and cluster."""
    for cfg in args.configs:
        parse_config(cfg)
    args.brackets = parse_brackets(args.capacity)
    for cfg in args.configs:
        bracket(args.brackets, cfg)
    if args.window < args.min_window or (args.warmup is not None and args.warmup < 0):
        raise ValueError(f"window must be >= {args.min_window} s and warmup >= 0")
    if args.max_points < 2 or args.rel_tol <= 0:
        raise ValueError("max_points must be >= 2 and rel_tol > 0")
    if args.tier_gb < 0:
        raise ValueError(f"tier_gb must be >= 0, got {args.tier_gb}")


def init_ray(args) -> None:
    import ray

    if ray.is_initialized():  # one cluster for every configuration
        return
    env = {"env_vars": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ}}
    env["env_vars"].setdefault("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env=env, log_to_driver=False)
        return
    ray.init(
        num_cpus=args.ray_num_cpus or os.cpu_count(),
        num_gpus=args.ray_num_gpus,
        include_dashboard=False,
        runtime_env=env,
        log_to_driver=False,
    )


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    args = build_parser().parse_args(argv)
    check_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = PRESETS[args.preset]
    args.timeout = p.slo if args.timeout is None else args.timeout
    args.warmup = p.slo if args.warmup is None else args.warmup
    if args.warmup < p.slo:
        logger.warning(
            "warm-up %.1f s < SLO %.1f s: requests slower than the warm-up lose window "
            "completions (fill_loss_share in each point)",
            args.warmup,
            p.slo,
        )
    args.deadline = t_start + args.budget_s if args.budget_s else float("inf")
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare(p, args.dataset, args.data or args.out / "data", nprobe=args.nprobe)
    import ray
    import torch

    if torch.cuda.is_available():  # NOTE: the index build's cached blocks: the actors need them
        torch.cuda.empty_cache()

    init_ray(args)
    meta = {
        "preset": args.preset,
        "argv": sys.argv if argv is None else argv,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "nprobe": data["nprobe"],
        "workflow": args.workflow,
        "warmup_s": args.warmup,
        "window_s": args.window,
        "slo_s": p.slo,
        "tier_gb": args.tier_gb,
        "prepare_s": time.monotonic() - t_start,
    }
    meta["cluster"] = {k: float(v) for k, v in ray.cluster_resources().items() if "node" not in k}
    entries: list[dict] = []
    path = args.out / "results.json"

    def save() -> None:  # after every point: a cut-off run keeps what it has
        tmp = path.with_suffix(".tmp")
        doc = {"meta": meta, "summary": summarize_configs(entries), "configs": entries}
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)

    state = {"offset": 0}
    try:
        for cfg in args.configs:
            if time.monotonic() + START_ALLOWANCE_S + 2 * args.window > args.deadline:
                logger.warning("skipping %s and later configurations: --budget-s", cfg)
                meta["skipped"] = args.configs[args.configs.index(cfg) :]
                break
            entry: dict = {"config": cfg, "points": []}
            entries.append(entry)
            try:
                bench_config(cfg, p, data, args, state, entry, save)
            except Exception as exc:  # noqa: BLE001 - recorded; the next configuration runs
                logger.exception("%s failed", cfg)
                entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            save()
    finally:
        save()
        ray.shutdown()
    logger.info("capacity: %s", json.dumps(summarize_configs(entries)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
