"""Retrieval latency under Poisson arrivals: one-shot batches vs sub-stages (HedraRAG Fig. 16).

The retrieval worker's loop, alone in one process, fed individual queries at a rate:

- ``oneshot``: everything queued since the last search is searched as one batch (the
  runtime's plain path: naive async);
- ``split``: staged tasks, one sub-stage per loop iteration under the Eq. 1 budget ``mb``
  (measured online), new queries joining at sub-stage boundaries.

Both runs see the same arrival times and queries and alternate point by point. Reports mean
and p90 query latency (arrival to result) and the budget the cost model chose.

    python bench/rag_split_latency.py --index DIR --nprobe 256 --rates 5 10 20 --num 200
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def run_once(runner, tasks: list, times: np.ndarray) -> np.ndarray:
    """Feed ``tasks[i]`` at ``times[i]`` (s from start); latency of each (arrival -> result)."""
    start = time.perf_counter()
    done = np.full(len(tasks), np.nan)
    index_of = {t.task_id: i for i, t in enumerate(tasks)}
    nxt = 0
    while nxt < len(tasks) or runner.has_pending():
        now = time.perf_counter() - start
        batch = []
        while nxt < len(tasks) and times[nxt] <= now:
            batch.append(tasks[nxt])
            nxt += 1
        if not batch and not runner.has_pending():
            time.sleep(max(0.0, min(times[nxt] - now, 0.01)))
            continue
        updates = runner.run(batch)
        end = time.perf_counter() - start
        for u in updates:
            if getattr(u, "finished", True):
                done[index_of[u.task_id]] = end
    return done - times


def main(argv: list[str] | None = None) -> int:
    from ragserve.retrieval import VectorIndex, load_embedder
    from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
    from ragserve.scheduler import RetrievalTask
    from ragserve.scheduler.messages import StagedRetrievalTask

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--index", required=True)
    ap.add_argument("--nprobe", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=[5.0, 10.0, 20.0])
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    index = VectorIndex.load(args.index)
    embedder = load_embedder(index.embedder_name)
    rows = []
    for rate in args.rates:
        times = np.cumsum(np.random.default_rng(0).exponential(1.0 / rate, args.num))
        queries = [f"Question {i}: retrieval latency probe" for i in range(args.num)]
        for mode in ("oneshot", "split", "oneshot", "split"):  # alternate, twice each
            runner = StagedRetrievalRunner(index, embedder, args.nprobe)
            runner.run([StagedRetrievalTask("warm", "warm-up", 2, split=True)])
            while runner.has_pending():
                runner.run([])
            if mode == "oneshot":
                tasks = [RetrievalTask(f"q{i}", q, args.topk) for i, q in enumerate(queries)]
            else:
                tasks = [
                    StagedRetrievalTask(f"q{i}", q, args.topk, split=True)
                    for i, q in enumerate(queries)
                ]
            lat = run_once(runner, tasks, times)
            row = {
                "rate": rate,
                "mode": mode,
                "mean_s": float(np.nanmean(lat)),
                "p90_s": float(np.nanpercentile(lat, 90)),
                "budget_s": runner.search.cost.budget(),
                "beta_s": runner.search.cost.beta,
                "t_retrieval_s": runner.search.cost.mean_stage_seconds,
                "steps": runner.search.num_steps,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
