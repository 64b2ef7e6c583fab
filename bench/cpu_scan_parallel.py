"""The CPU scan one-thread vs parallel over queries (``stepwise.set_scan_threads``), and Faiss's
own ``parallel_mode`` 3 for reference, on one index: per-batch seconds, interleaved repeats, the
ratios of each repeat (their median and spread: a shared machine is noisy). Checks that every
variant returns bit-identical ids and scores. Writes JSON to ``--out`` (and prints it).

    PYTHONPATH=src python bench/cpu_scan_parallel.py --num-docs 200000 --dim 128 --nlist 1024 \\
        --nprobe 32 --batch 32 64 --kind ivf_flat ivf_sq8 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np

from ragserve.retrieval import stepwise


def build(kind: str, num_docs: int, dim: int, nlist: int, seed: int = 0) -> faiss.IndexIVF:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((nlist, dim)).astype(np.float32)
    x = centers[rng.integers(0, nlist, num_docs)] + rng.standard_normal((num_docs, dim)) * 0.5
    index = stepwise.make_ivf(dim, nlist, kind, "ip")
    stepwise.train(index, x.astype(np.float32), max_train=64 * nlist)
    index.add(x.astype(np.float32))
    return index


def seconds(fn, calls: int) -> float:
    """Median seconds of ``calls`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def variants(index: faiss.IndexIVF, q: np.ndarray, plan, topk: int, threads: int) -> dict:
    def serial():
        stepwise.set_scan_threads(1)
        return stepwise.scan(index, q, plan, topk)

    def pool():
        stepwise.set_scan_threads(threads)
        return stepwise.scan(index, q, plan, topk)

    def omp_mode3():  # NOTE: Faiss's own per-query split (one call, OpenMP) for reference
        stepwise.set_scan_threads(1)
        index.parallel_mode = 3
        try:
            return stepwise.scan(index, q, plan, topk)
        finally:
            index.parallel_mode = 0

    return {"one_thread": serial, "parallel": pool, "faiss_mode3": omp_mode3}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--num-docs", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--kind", nargs="+", default=["ivf_flat", "ivf_sq8"], choices=stepwise.KINDS)
    ap.add_argument("--threads", type=int, default=None, help="default: Faiss's OpenMP threads")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per repeat (median)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    threads = args.threads or max(1, faiss.omp_get_max_threads())
    faiss.omp_set_num_threads(threads)
    rows = []
    for kind in args.kind:
        index = build(kind, args.num_docs, args.dim, args.nlist)
        qs = np.random.default_rng(1).standard_normal((max(args.batch), args.dim))
        for batch in args.batch:
            q = qs[:batch].astype(np.float32)
            plan = stepwise.assign(index, q, args.nprobe)
            fns = variants(index, q, plan, args.topk, threads)
            outs = {name: fn() for name, fn in fns.items()}
            base = outs["one_thread"]
            exact = all(
                np.array_equal(o.ids, base.ids) and np.array_equal(o.scores, base.scores)
                for o in outs.values()
            )
            per = {name: [] for name in fns}
            for _ in range(args.repeats):  # NOTE: interleaved, so load drifts hit every variant
                for name, fn in fns.items():
                    per[name].append(seconds(fn, args.calls))
            one = np.array(per["one_thread"])
            row = {"kind": kind, "batch": batch, "threads": threads, "bit_identical": exact}
            for name in ("parallel", "faiss_mode3"):
                ratio = one / np.array(per[name])
                row[f"{name}_speedup_median"] = round(float(np.median(ratio)), 3)
                row[f"{name}_speedup_min_max"] = [
                    round(float(ratio.min()), 3),
                    round(float(ratio.max()), 3),
                ]
            row["one_thread_ms_median"] = round(float(np.median(one)) * 1e3, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    stepwise.set_scan_threads(None)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
