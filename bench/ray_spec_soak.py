"""Soak check: does any request get lost on the Ray backend with speculation on?

Rounds of Poisson arrivals (``--round-size`` requests at ``--rate``) on one Ray-backed
``Server`` (``scale_bench``'s server, system ``ragserve``: split + similarity + speculation);
a request still unfinished ``--drain`` seconds after its round's last arrival is aborted and
counted as lost (the drain is long enough that a slow request is not mistaken for one). This
is the setting where one request in 600-900 was lost before the adoption fix
(docs/scale_out.md); it measures no speed.

    python bench/ray_spec_soak.py --preset smoke --config 2x1 --rate 16 --rounds 40 \\
        --out /tmp/soak                                                  # CPU, ~10 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_bench as sb  # noqa: E402
from rag_bench import arrivals, run_arrivals, workflow_graphs  # noqa: E402
from rag_setup import PRESETS, prepare  # noqa: E402

logger = logging.getLogger("ray_spec_soak")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--config", default="2x1", help="replicas x shards")
    ap.add_argument("--rate", type=float, default=16.0, help="arrivals per second")
    ap.add_argument("--round-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/ray_spec_soak"))
    return ap


def main(argv: list[str] | None = None) -> int:
    from ragserve.scheduler.cosched import SpeculationTransform

    args = build_parser().parse_args(argv)
    replicas, shards = sb.parse_config(args.config)
    if args.rate <= 0 or args.round_size < 2 or args.rounds < 1 or args.drain <= 0:
        raise SystemExit("rate and drain must be > 0, round-size >= 2, rounds >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare(p, "synthetic", args.out / "data")
    server_args = sb.build_parser().parse_args(["--preset", args.preset, "--capacity", "1:2"])
    sb.init_ray(server_args)
    server, chain = sb.start_server(replicas, shards, p, data, server_args)
    graph = workflow_graphs(p, data["nprobe"])["oneshot"]
    inner = [getattr(t, "inner", t) for t in chain]
    spec = next((t for t in inner if isinstance(t, SpeculationTransform)), None)
    rounds, questions = [], data["questions"]
    try:
        for k in range(args.rounds):
            times = arrivals(args.rate, args.round_size, args.seed + k)
            qs = [questions[(k * args.round_size + j) % len(questions)] for j in range(len(times))]
            t0 = time.monotonic()
            responses, _ = asyncio.run(
                run_arrivals(server, {"g": graph}, ["g"] * len(qs), qs, times, args.drain)
            )
            lost = [r.request_id for r in responses if r.error_kind == "aborted"]
            other = sorted({r.error for r in responses if r.error and r.error_kind != "aborted"})
            rounds.append(
                {
                    "round": k,
                    "num_requests": len(qs),
                    "lost": lost,
                    "other_errors": other,
                    "wall_s": time.monotonic() - t0,
                }  # fmt: skip
            )
            logger.info("round %d: %d requests, %d lost %s", k, len(qs), len(lost), other or "")
    finally:
        server.close()
        import ray

        ray.shutdown()
    s = getattr(spec, "stats", None)
    doc = {
        "argv": sys.argv if argv is None else argv,
        "num_requests": sum(r["num_requests"] for r in rounds),
        "num_lost": sum(len(r["lost"]) for r in rounds),
        "speculation": None if s is None else {**vars(s), "accuracy": s.accuracy},
        "rounds": rounds,
    }
    (args.out / "soak.json").write_text(json.dumps(doc, indent=1))
    logger.info("%d requests, %d lost", doc["num_requests"], doc["num_lost"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
