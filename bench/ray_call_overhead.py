"""Round trip of one Ray actor call on this machine (the floor of every shard fan-out and
replica submit): ``--calls`` sequential ``ray.get(actor.f.remote(x))`` with x a small int
and with a ``[32, dim]`` float32 array (the query block a shard receives), median ms; and
the caller's own cost of one ``actor.f.remote(x)`` without waiting (``submit_us``: what the
scheduler thread pays per task-list submit; the round trip overlaps other work).

    python bench/ray_call_overhead.py --calls 200
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--num-cpus", type=int, default=2)
    args = ap.parse_args(argv)
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Echo:
            def f(self, x):
                return x

        actor = Echo.remote()
        ray.get(actor.f.remote(0))
        out = {}
        block = np.zeros((32, args.dim), np.float32)
        for name, value in (("int", 1), (f"array_32x{args.dim}", block)):
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                ray.get(actor.f.remote(value))
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            refs = [actor.f.remote(value) for _ in range(args.calls)]
            submit = (time.perf_counter() - t0) / args.calls
            ray.get(refs)
            out[name] = {"median_ms": 1e3 * float(np.median(times)),
                         "p90_ms": 1e3 * float(np.percentile(times, 90)),
                         "submit_us": 1e6 * submit}  # fmt: skip
        print(json.dumps(out))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
