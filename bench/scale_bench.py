"""Scale-out benchmark: sustained RAG capacity with N LLM replicas x M index shards on Ray.

For each configuration ``RxS`` (replicas x shards) one Ray-backed ``Server`` runs the same
workload (``rag_bench``'s presets, questions and Poisson arrivals) at rising rates for
``--duration`` seconds (at least ``--min-requests``) each, after a warm-up. A rate is
*sustained* when SLO attainment is at least ``--target`` (0.9) and completed throughput is at
least ``--keep-up`` (0.95) x the offered rate (the realized Poisson rate of the point). The
grid stops at its first failed rate, then ``--bisect`` steps between the last sustained and
the first failed rate refine the capacity (``grid_bound`` when nothing failed: the top of the
sweep, a lower bound). Ratios are against the first configuration, measured in the same run
on the same cluster.

    python bench/scale_bench.py --preset smoke --configs 1x1 2x2 --rates 4 --duration 2 \
        --min-requests 8                                                          # CPU harness
    python bench/scale_bench.py --preset h200 --configs 1x1 2x1 1x2 2x2 \\
        --rates 2 4 8 16 32 --out bench/results/scale_h200                        # 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_bench import WORKFLOWS, _time_scheduler, arrivals, measure, workflow_graphs  # noqa: E402
from rag_setup import PRESETS, prepare  # noqa: E402
from rag_systems import SYSTEMS, system_transforms  # noqa: E402

logger = logging.getLogger("scale_bench")


def parse_config(text: str) -> tuple[int, int]:
    """``"2x1"`` -> (2 replicas, 1 shard)."""
    try:
        replicas, shards = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a configuration is REPLICASxSHARDS like 2x1, got {text!r}") from None
    if replicas < 1 or shards < 1:
        raise ValueError(f"replicas and shards must be >= 1, got {text!r}")
    return replicas, shards


def capacity(rows: list[dict]) -> tuple[float | None, bool]:
    """(highest sustained rate below the lowest failed one, whether nothing failed: then the
    capacity is the top of the sweep, a lower bound)."""
    failed = [r["rate"] for r in rows if not r["sustained"]]
    limit = min(failed, default=float("inf"))
    ok = [r["rate"] for r in rows if r["sustained"] and r["rate"] < limit]
    return max(ok, default=None), not failed


def start_server(replicas: int, shards: int, p, data: dict, args):
    from ragserve.runtime import Server, ServerConfig

    chain = system_transforms(args.system, first_clusters=p.first_clusters)
    config = ServerConfig(
        backend="ray",
        num_llm_replicas=replicas,
        num_index_shards=shards,
        ray_address=args.ray_address,
        shard_partition=args.partition,
        engine_kwargs=data["engine_kwargs"],
        default_nprobe=data["nprobe"],
        transforms=chain,
        max_active_requests=4096,
    )
    server = Server(data["model"], data["index"], config=config)
    warm_up(server, replicas, data["questions"], workflow_graphs(p)["oneshot"])
    return server, chain


def warm_up(server, replicas: int, questions: list[str], graph, max_rounds: int = 8) -> None:
    """Concurrent requests until every replica has run a task (not measured): a replica's
    first batch pays one-time costs (allocator, kernels) that must not land in a point."""
    import asyncio

    for k in range(max_rounds):
        batch = questions[-(k + 1) * 2 * replicas :][: 2 * replicas]

        async def go(batch=batch):
            return await asyncio.gather(*(server.submit(q, graph) for q in batch))

        asyncio.run(go())
        workers = server.stats()["workers"]
        if all(workers[f"llm_{i}"].get("tasks", 0) > 0 for i in range(replicas)):
            return
    logger.warning("warm-up: some replica got no task in %d rounds", max_rounds)


def bench_config(cfg: str, p, data: dict, args, offset: int) -> list[dict]:
    replicas, shards = parse_config(cfg)
    t0 = time.monotonic()
    server, chain = start_server(replicas, shards, p, data, args)
    start_s = time.monotonic() - t0
    clock = _time_scheduler(server)
    rows: list[dict] = []

    def point(rate: float) -> bool:
        k = len(rows)
        pt = {"workflow": args.workflow, "rate": float(rate), "nprobe": data["nprobe"]}
        first = (offset + k) * args.max_requests  # fresh questions for every point
        row = measure(server, clock, chain, args.system, p, data, args, pt, first)
        n = row["num_requests"]
        offered = n / float(arrivals(rate, n, args.seed)[-1])  # realized Poisson arrival rate
        tput = row["throughput_rps"] or 0.0
        row.update(config=cfg, replicas=replicas, shards=shards, start_s=start_s)
        row["offered_rps"] = offered
        row["sustained"] = bool(
            row["slo_attainment"] >= args.target and tput >= args.keep_up * offered
        )
        row["workers"] = server.stats()["workers"]
        rows.append(row)
        return row["sustained"]

    try:
        low, high = 0.0, None
        for rate in sorted(args.rates):
            if not point(rate):
                high = rate
                break
            low = rate
        for _ in range(args.bisect if high is not None else 0):
            mid = (low + high) / 2
            if point(mid):
                low = mid
            else:
                high = mid
    finally:
        server.close()
    return rows


def summarize_configs(rows: list[dict], configs: list[str]) -> dict:
    out = {}
    for cfg in configs:
        mine = [r for r in rows if r["config"] == cfg]
        cap, grid_bound = capacity(mine)
        ms = [r["scheduler_ms_per_node"] for r in mine]
        out[cfg] = {
            "capacity_rps": cap,
            "grid_bound": grid_bound,
            "scheduler_ms_per_node": min(ms) if ms else None,
        }
    base = out[configs[0]]["capacity_rps"]
    for entry in out.values():
        cap = entry["capacity_rps"]
        entry["ratio_vs_first"] = None if not base or cap is None else cap / base
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--dataset", choices=("synthetic", "factbook"), default="synthetic")
    ap.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2", "2x2"])
    ap.add_argument("--system", choices=SYSTEMS, default="ragserve")
    ap.add_argument("--workflow", choices=(*WORKFLOWS, "mix"), default="oneshot")
    ap.add_argument("--rates", nargs="+", type=float, required=True)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument("--max-requests", type=int, default=4096)
    ap.add_argument("--target", type=float, default=0.9, help="SLO attainment to sustain")
    ap.add_argument(
        "--keep-up", type=float, default=0.95, help="completed / offered rate to sustain"
    )
    ap.add_argument("--bisect", type=int, default=3, help="bisection steps past the grid")
    ap.add_argument("--partition", choices=("list", "document"), default="document")
    ap.add_argument("--ray-address", default=None, help="join this cluster (default: local)")
    ap.add_argument("--ray-num-cpus", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale"))
    args = ap.parse_args(argv)
    for cfg in args.configs:
        parse_config(cfg)  # NOTE: bad input fails before the (slow) index and cluster
    if min(args.rates) <= 0 or args.duration <= 0:
        raise ValueError("rates and duration must be > 0")
    args.num_requests = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = PRESETS[args.preset]
    args.point_timeout = 2 * p.slo
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare(p, args.dataset, args.out / "data")
    import ray

    if not ray.is_initialized():  # one cluster for every configuration
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            cpus = args.ray_num_cpus or os.cpu_count()
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    meta = {
        "preset": args.preset,
        "argv": sys.argv,
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    meta["cluster"] = {k: float(v) for k, v in ray.cluster_resources().items() if "node" not in k}
    rows: list[dict] = []
    path = args.out / "results.json"
    try:
        for i, cfg in enumerate(args.configs):
            rows += bench_config(cfg, p, data, args, offset=i * len(args.rates))
            summary = summarize_configs(rows, args.configs[: i + 1])
            path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    finally:
        ray.shutdown()
    logger.info("capacity: %s", json.dumps(summarize_configs(rows, args.configs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
