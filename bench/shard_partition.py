"""Which shard partition: inverted lists (balanced by size) or documents (id hash)?

Builds a skewed synthetic IVF index (queries follow the corpus' Zipf-like topic popularity),
splits it both ways, and times every shard's part of each batch in this process, one shard
after another: a batch's *critical path* is its slowest shard (shards run in parallel on
their own nodes), *total* the sum (the cluster's CPU time). Also counts the shards a query
touches, for whole searches and for one co-scheduling sub-stage (the first ``--substage``
clusters of each query). Results are checked against the one-shot search on the way.

    python bench/shard_partition.py --out bench/results/shard_partition.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bulk_build import build_index_directory  # noqa: E402
from rag_setup import synthetic_questions  # noqa: E402
from synthetic_corpus import synthetic_corpus  # noqa: E402

logger = logging.getLogger("shard_partition")


def build(root: Path, args) -> Path:
    from ragserve.retrieval.synthetic import SyntheticSpec

    spec = SyntheticSpec(dim=args.dim, num_topics=args.num_topics)
    docs, x = synthetic_corpus(spec, args.num_docs, device="cpu")
    build_index_directory(root / "src", docs, x, embedder_name=spec.name, nlist=args.nlist)
    return root / "src"


def time_part(server, q: np.ndarray, part, k: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        server.scan(q, part, k)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(sharded, q: np.ndarray, plan, k: int, repeats: int) -> dict:
    parts = sharded.fan_out(plan)
    times = [time_part(shard.server, q, part, k, repeats) for shard, part in parts]
    touched = np.zeros(len(q))
    for _, part in parts:
        touched += (part.cluster_ids >= 0).any(axis=1)
    return {
        "critical_ms": 1e3 * max(times),
        "total_ms": 1e3 * sum(times),
        "shards_per_query": float(touched.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--num-docs", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--nlist", type=int, default=512)
    ap.add_argument("--num-topics", type=int, default=512)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--nprobes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--substage", type=int, default=8)
    ap.add_argument("--num-batches", type=int, default=8, help="batches per point")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.shard_split import split_index
    from ragserve.retrieval.sharded import ShardedIndex
    from ragserve.retrieval.synthetic import SyntheticEmbedder, SyntheticSpec

    tmp = Path(tempfile.mkdtemp(prefix="shard-partition-"))
    src = build(tmp, args)
    one = VectorIndex.load(src)
    emb = SyntheticEmbedder(SyntheticSpec(dim=args.dim, num_topics=args.num_topics))
    rows = []
    for m in args.shards:
        for partition in ("list", "document"):
            split_index(src, tmp / f"{partition}-{m}", m, partition)
            sharded = ShardedIndex.open_local(tmp / f"{partition}-{m}")
            for nprobe in args.nprobes:
                for batch in args.batches:
                    n = batch * args.num_batches
                    q = emb.encode(synthetic_questions(n + 7919)[7919:], is_query=True)
                    plan = sharded.assign(q, nprobe)
                    exact = sharded.scan(q, plan, args.topk)  # also warms every shard up
                    assert np.array_equal(exact.ids, one.search(q, args.topk, nprobe).ids)
                    for stage, width in (("search", nprobe), ("substage", args.substage)):
                        pts = [
                            measure(
                                sharded,
                                q[i : i + batch],
                                plan.rows(i, i + batch).columns(0, width),
                                args.topk,
                                args.repeats,
                            )
                            for i in range(0, n, batch)
                        ]
                        row = {k: float(np.mean([p[k] for p in pts])) for k in pts[0]}
                        row.update(shards=m, partition=partition, nprobe=nprobe, batch=batch)
                        row["stage"] = stage
                        rows.append(row)
                        logger.info("%s", json.dumps(row))
    text = json.dumps({"argv": sys.argv, "rows": rows}, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(_table(rows))
    return 0


def _table(rows: list[dict]) -> str:
    lines = ["shards nprobe batch stage    | list crit/total/fan-out | document crit/total/fan-out"]
    key = lambda r: (r["shards"], r["nprobe"], r["batch"], r["stage"])  # noqa: E731
    by = {(key(r), r["partition"]): r for r in rows}
    for k in sorted({key(r) for r in rows}):
        a, b = by[(k, "list")], by[(k, "document")]
        lines.append(
            f"{k[0]:>6} {k[1]:>6} {k[2]:>5} {k[3]:<8} | "
            f"{a['critical_ms']:6.2f} {a['total_ms']:6.2f} {a['shards_per_query']:4.2f}  | "
            f"{b['critical_ms']:6.2f} {b['total_ms']:6.2f} {b['shards_per_query']:4.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
