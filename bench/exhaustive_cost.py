"""What an exhaustive IVF scan costs per query vs index size (dim 384, MiniLM's), one thread:
the basis of `calibrate.EXHAUSTIVE_MAX_VECTORS` (below it, the default probes every cluster).

Reports ms/query at batch 1 for nprobe = nlist (exhaustive) and nprobe = nlist/4 (the previous
default), median of interleaved repeats.

    .venv/bin/python bench/exhaustive_cost.py [--sizes 5000,20000,80000]
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np

from ragserve.retrieval import auto_nlist, stepwise


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="5000,20000,80000")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    dim = 384
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        centers = rng.normal(size=(64, dim))
        x = centers[rng.integers(0, 64, n)] + rng.normal(size=(n, dim))
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        nlist = auto_nlist(n)
        index = stepwise.make_ivf(dim, nlist, "ivf_flat", "ip")
        stepwise.train(index, x, max_train=256 * nlist)
        index.add(x)
        q = x[rng.choice(n, args.queries, replace=False)] + 0.01
        times: dict[int, list[float]] = {nlist: [], max(1, nlist // 4): []}
        for _ in range(args.repeats):
            for nprobe in times:
                params = faiss.SearchParametersIVF(nprobe=nprobe)
                t0 = time.perf_counter()
                for i in range(len(q)):
                    index.search(q[i : i + 1], 10, params=params)
                times[nprobe].append((time.perf_counter() - t0) / len(q) * 1e3)
        row = {"num_vectors": n, "nlist": nlist}
        for nprobe, ts in times.items():
            label = "exhaustive" if nprobe == nlist else "nlist/4"
            row[f"ms_per_query_{label}"] = round(float(np.median(ts)), 3)
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
