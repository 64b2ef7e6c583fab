"""Does ragserve's CPU scan use several threads? Counts this process's threads after a
``stepwise.scan`` (Faiss ``search_preassigned``) switched to one thread
(``stepwise.set_scan_threads(1)``), after one at the default (parallel over queries, as many
threads as Faiss's OpenMP), and after a Faiss ``search`` of the same batch, OpenMP allowed
``--threads`` threads; run in a fresh process (the pools, once made, stay). Linux only
(``/proc/self/task``).

    PYTHONPATH=src python bench/faiss_scan_threads.py
"""

from __future__ import annotations

import argparse
import os

import faiss
import numpy as np

from ragserve.retrieval import stepwise
from ragserve.retrieval.types import ProbePlan


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    faiss.omp_set_num_threads(1)  # build and assign without making the pool
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20000, 32)).astype(np.float32)
    q = rng.standard_normal((32, 32)).astype(np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(32), 32, 16, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    dists, lists = index.quantizer.search(q, 8)
    faiss.omp_set_num_threads(args.threads)

    def count() -> int:
        return len(os.listdir("/proc/self/task"))

    print(f"parallel_mode {index.parallel_mode}, OpenMP threads allowed {args.threads}")
    print(f"threads before any scan: {count()}")
    previous = stepwise.set_scan_threads(1)
    one = stepwise.scan(index, q, ProbePlan(lists, dists), 10)
    print(f"after a one-thread stepwise.scan (search_preassigned) of 32 queries: {count()}")
    stepwise.set_scan_threads(previous)
    par = stepwise.scan(index, q, ProbePlan(lists, dists), 10)
    print(
        f"after a default stepwise.scan ({stepwise.scan_threads()} threads) of the same 32: "
        f"{count()}; bit-identical: {np.array_equal(one.ids, par.ids)}"
        f" {one.scores.tobytes() == par.scores.tobytes()}"
    )
    index.nprobe = 8
    index.search(q, 10)
    print(f"after index.search of the same 32 queries: {count()}")


if __name__ == "__main__":
    main()
