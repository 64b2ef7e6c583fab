"""Retrieval alone with the GPU tier (issue 10): queries/s and p90 latency vs GPU coverage, next
to CPU-only Faiss and exhaustive GPU search (the ceiling), on a synthetic Zipf-skewed corpus.

    python bench/bench_gpu_tier.py --num-docs 5000000 --dim 768 --nlist 4096 --topics 16384 \
        --nprobe 128 256 512 --coverage 0 5 10 20 50 100 --out bench/results/gpu_tier_h200.json

    python bench/bench_gpu_tier.py ... --coverage 100 50 --batch 1 32 256 \
        --scan grouped dense fused auto --check-queries 64   # the scan strategies side by side
        [--assign faiss tier]   # and index.search's coarse assignment: Faiss (CPU) vs the tier

    OMP_NUM_THREADS=14 python bench/bench_gpu_tier.py ... --nprobe 256 --batch 1 32 256 \
        --cpu-scan-threads 14 1 --faiss-oneshot --cpu-only   # the CPU baseline both ways

Every figure is measured in this one process, side by side: the same index, queries and batch
size. Coverage = share of lists on the GPU, hottest first by the access counts of a warm-up
query sample (the placement `set_gpu_tier` would make). Each point also checks its ids against
the CPU-only result (`exact_ids`: share of identical rows). The CPU-only points run once per
`--cpu-scan-threads` value (`stepwise.set_scan_threads`: 1 is the one-thread scan ragserve had
before 2026-12-01, 0 the default, Faiss's OpenMP thread count), each checked against the first;
`--faiss-oneshot` adds Faiss's own `index.search` (its OpenMP split of the batch).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import gpu_kmeans
from synthetic_corpus import synthetic_corpus

logger = logging.getLogger("bench_gpu_tier")


def build_index(args: argparse.Namespace, device: str) -> tuple[Any, Any, dict]:
    """An in-memory VectorIndex (no document store rows: search only) and the synthetic spec."""
    import faiss

    from ragserve.retrieval import stepwise
    from ragserve.retrieval.docstore import DocStore
    from ragserve.retrieval.index import IndexSpec, VectorIndex
    from ragserve.retrieval.synthetic import SyntheticSpec

    seconds: dict[str, float] = {}
    spec = SyntheticSpec(dim=args.dim, num_topics=args.topics, zipf_a=args.zipf)
    t0 = time.perf_counter()
    _, x = synthetic_corpus(spec, args.num_docs, device=device)
    seconds["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    sample = x[np.sort(rng.choice(len(x), min(len(x), 256 * args.nlist), replace=False))]
    centroids = gpu_kmeans.kmeans(sample, args.nlist, "ip", device=device, seed=0)
    labels = gpu_kmeans.assign(x, centroids, "ip", device=device)
    seconds["kmeans_assign"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = stepwise.make_ivf(args.dim, args.nlist, "ivf_flat", "ip")
    index.quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    index.is_trained = True
    step = 1 << 20
    for a in range(0, len(x), step):
        b = min(a + step, len(x))
        ids = np.arange(a + 1, b + 1, dtype=np.int64)
        lab = np.ascontiguousarray(labels[a:b], dtype=np.int64)
        index.add_core(b - a, faiss.swig_ptr(x[a:b]), faiss.swig_ptr(ids), faiss.swig_ptr(lab))
    seconds["add"] = time.perf_counter() - t0
    ispec = IndexSpec(args.dim, args.nlist, "ivf_flat", "ip", spec.name, 256)
    return VectorIndex(index, DocStore(None), ispec), (spec, x), seconds


def make_queries(spec: Any, n: int, seed: int) -> np.ndarray:
    from ragserve.retrieval.synthetic import SyntheticEmbedder

    emb = SyntheticEmbedder(spec)
    return emb.encode([f"Question {seed}-{i}: what about it?" for i in range(n)])


def timed(fn: Any, q: np.ndarray, batch: int, min_s: float, max_batches: int) -> dict:
    """Consecutive batches of ``q`` through ``fn`` (after one warm-up batch): queries/s and
    per-batch latency percentiles (seconds)."""
    fn(q[:batch])
    lat = []
    start = time.perf_counter()
    pos = batch
    while len(lat) < max_batches and (len(lat) < 2 or time.perf_counter() - start < min_s):
        if pos + batch > len(q):
            pos = 0
        t0 = time.perf_counter()
        fn(q[pos : pos + batch])
        lat.append(time.perf_counter() - t0)
        pos += batch
    total = time.perf_counter() - start
    a = np.asarray(lat)
    return {
        "batch": batch,
        "num_batches": len(lat),
        "qps": batch * len(lat) / total,
        "p50_s": float(np.percentile(a, 50)),
        "p90_s": float(np.percentile(a, 90)),
    }


def exact_share(found: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean(np.all(found == ref, axis=1)))


def recall(found: np.ndarray, ref: np.ndarray) -> float:
    k = ref.shape[1]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found, ref, strict=True)]))


class Results:
    """The JSON document, rewritten after each section (partial runs keep what they got)."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path, self.doc = path, {"meta": meta, "points": []}

    def add(self, **point: Any) -> None:
        self.doc["points"].append(point)
        logger.info("%s", json.dumps(point))
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.doc, indent=1, default=_plain))


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays as JSON numbers, booleans and lists."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def exhaustive(
    res: Results, x: np.ndarray, q: np.ndarray, args: argparse.Namespace, device: str = "cuda"
) -> None:
    """The ceiling: every vector scored (no IVF), torch matmul + topk on ``device``."""
    import torch

    batches = args.batch if args.scan else [*args.batch, args.peak_batch]
    for dtype in ("float16", "float32"):
        if device == "cpu" and dtype == "float16":
            continue  # NOTE: CPU half matmuls are emulated: no ceiling worth the time
        xd = torch.from_numpy(x).to(device).to(getattr(torch, dtype))

        def run(batch: np.ndarray, xd=xd) -> np.ndarray:
            qd = torch.from_numpy(batch).to(device).to(xd.dtype)
            return (qd @ xd.T).float().topk(args.topk, dim=1).indices.cpu().numpy()

        for batch in batches:
            stats = timed(run, q, batch, args.min_seconds, args.max_batches)
            res.add(system="exhaustive_gpu", dtype=dtype, device=device, **stats)
        del xd
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare_scans(
    res: Results, index: Any, q: np.ndarray, hot: np.ndarray, args: argparse.Namespace, device: str
) -> None:
    """The tier's scan strategies side by side (``--scan``): per coverage, nprobe, strategy and
    batch, the tier's part alone (``tier_scan``: probes assigned beforehand, the GPU scan and
    its result) and, with the whole index resident, ``index.search`` end to end (per
    ``--assign`` mode: Faiss's CPU quantizer or the tier's ``DeviceAssigner``) and the coarse
    assignment alone (``assign_stage``); every strategy's ids checked against CPU-only Faiss on
    ``--check-queries`` queries."""
    check = q[: args.check_queries]
    index.drop_gpu_tier()
    refs = {n: index.search(check, args.topk, n).ids for n in args.nprobe}
    plans = {n: index.assign(q, n).cluster_ids for n in args.nprobe}
    for cov in args.coverage:
        num = int(round(cov / 100 * args.nlist))
        if num == 0:
            continue
        t0 = time.perf_counter()
        tier = index.set_gpu_tier(
            1 << 40, device=device, clusters=hot[:num].tolist(), scan="grouped", assign="tier"
        )
        load_s = time.perf_counter() - t0
        assigner = tier.assigner
        t0 = time.perf_counter()
        model = tier.calibrate()
        res.add(
            system="calibration",
            coverage=cov,
            num_clusters=num,
            tier_bytes=tier.num_bytes,
            load_seconds=load_s,
            calibrate_seconds=time.perf_counter() - t0,
            dense=model.dense if model else None,
            grouped=model.grouped if model else None,
            fused=model.fused if model else None,
            strategies=list(tier.strategies),
        )
        for nprobe in args.nprobe:
            for scan in args.scan:
                tier.set_scan(scan)
                tier.assigner = None
                exact = exact_share(index.search(check, args.topk, nprobe).ids, refs[nprobe])

                def part(rows: np.ndarray, n=nprobe, tier=tier) -> None:
                    pending, _ = tier.scan(q[rows], plans[n][rows], args.topk)
                    if pending is not None:
                        pending.result()

                def whole(batch: np.ndarray, n=nprobe) -> None:
                    index.search(batch, args.topk, n)

                for batch in args.batch:
                    before = tier.scan_counts
                    stats = timed(
                        part, np.arange(len(q)), batch, args.min_seconds, args.max_batches
                    )
                    after = tier.scan_counts
                    chosen = {k: after[k] - before[k] for k in after}
                    point = dict(nprobe=nprobe, coverage=cov, scan=scan, exact_ids=exact)
                    res.add(system="tier_scan", chosen=chosen, **point, **stats)
                    if cov == 100:
                        end_to_end(
                            res, index, tier, assigner, whole, q, check, refs, point, batch, args
                        )
            if args.fused_blocks:
                fused_blocks(res, index, tier, q, plans[nprobe], refs[nprobe], cov, nprobe, args)
        if cov == 100:
            assign_stages(res, index, assigner, q, args)
    index.drop_gpu_tier()


def fused_blocks(res, index, tier, q, plan, ref, cov, nprobe, args) -> None:
    """The fused scan's tier part at other (chunk rows, components) blocks per program
    (``--fused-blocks``; the module's defaults restored after), each compiled first."""
    import torch

    from ragserve.retrieval import tier_scan

    default = (tier_scan.FUSED_BLOCK_N, tier_scan.FUSED_BLOCK_D)
    tier.set_scan("fused")
    try:
        for spec in args.fused_blocks:
            rows, comps = (int(v) for v in spec.split("x"))
            tier_scan.FUSED_BLOCK_N, tier_scan.FUSED_BLOCK_D = rows, comps
            tier_scan.fused_warm_up(torch, tier._pool)
            found = index.search(q[: args.check_queries], args.topk, nprobe).ids

            def part(idx: np.ndarray) -> None:
                pending, _ = tier.scan(q[idx], plan[idx], args.topk)
                if pending is not None:
                    pending.result()

            for batch in args.batch:
                stats = timed(part, np.arange(len(q)), batch, args.min_seconds, args.max_batches)
                res.add(
                    system="tier_scan",
                    scan=f"fused:{spec}",
                    nprobe=nprobe,
                    coverage=cov,
                    exact_ids=exact_share(found, ref),
                    **stats,
                )
    finally:
        tier_scan.FUSED_BLOCK_N, tier_scan.FUSED_BLOCK_D = default


def end_to_end(res, index, tier, assigner, whole, q, check, refs, point, batch, args) -> None:
    """``index.search`` timed per ``--assign`` mode (interleaved with the tier part above)."""
    nprobe = point["nprobe"]
    for mode in args.assign:
        tier.assigner = assigner if mode == "tier" else None
        before = (assigner.num_rows, assigner.num_band_rows, assigner.num_fallback_rows)
        stats = timed(whole, q, batch, args.min_seconds, args.max_batches)
        counts = dict(
            zip(
                ("rows", "band_rows", "fallback_rows"),
                np.subtract(
                    (assigner.num_rows, assigner.num_band_rows, assigner.num_fallback_rows),
                    before,
                ).tolist(),
                strict=True,
            )
        )
        found = index.search(check, args.topk, nprobe).ids
        info = {k: v for k, v in point.items() if k != "exact_ids"}
        res.add(
            system="gpu_tier",
            assign=mode,
            exact_ids=exact_share(found, refs[nprobe]),
            assigner_counts=counts,
            **info,
            **stats,
        )
    tier.assigner = None


def assign_stages(res, index, assigner, q, args) -> None:
    """The coarse assignment alone: Faiss's CPU quantizer (``index.assign``) vs the tier's
    ``DeviceAssigner`` (its wait for the device included), per nprobe and batch."""
    for nprobe in args.nprobe:
        for batch in args.batch:
            for mode in args.assign:
                if mode == "tier":
                    fn = lambda b, n=nprobe: assigner.assign(b, n)  # noqa: E731
                else:
                    fn = lambda b, n=nprobe: index.assign(b, n)  # noqa: E731
                stats = timed(fn, q, batch, args.min_seconds, args.max_batches)
                res.add(system="assign_stage", assign=mode, nprobe=nprobe, **stats)


def cpu_baseline(
    res: Results,
    index: Any,
    q: np.ndarray,
    check: np.ndarray,
    nprobe: int,
    args: argparse.Namespace,
) -> np.ndarray:
    """CPU-only points at ``nprobe``, once per ``--cpu-scan-threads`` value (the first one is
    left set, for the tier's CPU part), and Faiss's one-shot search with ``--faiss-oneshot``;
    returns the first value's ids of ``check``, against which the others' ``exact_ids`` are
    counted."""
    import faiss

    from ragserve.retrieval import stepwise

    ref = None
    for threads in args.cpu_scan_threads:
        stepwise.set_scan_threads(threads or None)
        found = index.search(check, args.topk, nprobe).ids
        ref = found if ref is None else ref
        for batch in [] if args.skip_cpu else args.batch:
            stats = timed(
                lambda b, n=nprobe: index.search(b, args.topk, n),
                q,
                batch,
                args.min_seconds,
                args.max_batches,
            )
            res.add(
                system="cpu_faiss",
                scan_threads=stepwise.scan_threads(),
                nprobe=nprobe,
                coverage=0.0,
                exact_ids=exact_share(found, ref),
                **stats,
            )
    if args.faiss_oneshot and not args.skip_cpu:
        ivf = index.faiss_index
        params = faiss.SearchParametersIVF(nprobe=nprobe)
        found = ivf.search(check, args.topk, params=params)[1]
        for batch in args.batch:
            stats = timed(
                lambda b: ivf.search(b, args.topk, params=params),
                q,
                batch,
                args.min_seconds,
                args.max_batches,
            )
            res.add(
                system="cpu_faiss_oneshot",
                nprobe=nprobe,
                coverage=0.0,
                exact_ids=exact_share(found, ref),
                **stats,
            )
    stepwise.set_scan_threads(args.cpu_scan_threads[0] or None)
    return ref


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def add_corpus_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic corpus's options (``build_index``, ``make_queries``), shared with
    ``bench_tier_overflow.py``."""
    ap.add_argument("--num-docs", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--topics", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=1.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    add_corpus_args(ap)
    ap.add_argument("--nprobe", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--coverage", type=float, nargs="+", default=[0, 5, 10, 20, 50, 100])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--peak-batch", type=int, default=256, help="also at 100%% coverage")
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--num-queries", type=int, default=4096)
    ap.add_argument("--min-seconds", type=float, default=4.0)
    ap.add_argument("--max-batches", type=int, default=200)
    ap.add_argument("--device", default=None, help="tier device (default cuda when present)")
    ap.add_argument("--skip-exhaustive", action="store_true")
    ap.add_argument(
        "--scan",
        nargs="+",
        choices=["grouped", "dense", "fused", "auto"],
        default=None,
        help="compare these tier scan strategies (coverage x nprobe x batch) instead of the sweep",
    )
    ap.add_argument(
        "--assign",
        nargs="+",
        choices=["faiss", "tier"],
        default=["faiss", "tier"],
        help="with --scan: index.search's coarse assignment modes timed at 100%% coverage",
    )
    ap.add_argument(
        "--fused-blocks",
        nargs="*",
        default=[],
        help="with --scan: the fused scan's tier part also at these ROWSxCOMPONENTS blocks per "
        "program (e.g. 32x32 128x32; the default is tier_scan.FUSED_BLOCK_N x FUSED_BLOCK_D)",
    )
    ap.add_argument("--check-queries", type=int, default=256, help="ids checked against Faiss")
    ap.add_argument(
        "--skip-cpu",
        action="store_true",
        help="no CPU-only points; ids are checked against the float32 whole-index tier",
    )
    ap.add_argument(
        "--cpu-scan-threads",
        type=int,
        nargs="+",
        default=[0],
        help="the CPU-only points once per value (1: one thread; 0: Faiss's OpenMP threads)",
    )
    ap.add_argument("--faiss-oneshot", action="store_true", help="also Faiss's index.search")
    ap.add_argument("--cpu-only", action="store_true", help="stop after the CPU-only points")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_tier.json"))
    args = ap.parse_args(argv)
    for spec in args.fused_blocks:
        parts = spec.split("x")
        if len(parts) != 2 or not all(p.isdigit() and _pow2_at_least_16(int(p)) for p in parts):
            ap.error(f"--fused-blocks: ROWSxCOMPONENTS with powers of two >= 16, got {spec!r}")
    if any(t < 0 for t in args.cpu_scan_threads):
        ap.error(f"--cpu-scan-threads must be >= 0, got {args.cpu_scan_threads}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import faiss
    import torch

    from ragserve.retrieval import tier_scan
    from ragserve.retrieval.partition import hottest_first

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    index, (spec, x), build_s = build_index(args, "cuda" if torch.cuda.is_available() else "cpu")
    meta = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "faiss_threads": faiss.omp_get_max_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "build_seconds": build_s,
        "cluster_size_max": int(index.cluster_sizes().max()),
        "fused_blocks": f"{tier_scan.FUSED_BLOCK_N}x{tier_scan.FUSED_BLOCK_D}",
    }
    res = Results(args.out, meta)
    q = make_queries(spec, args.num_queries, seed=1)
    warm = make_queries(spec, 2048, seed=2)
    for nprobe in args.nprobe:  # the placement profile: probes of a warm-up sample
        index.access_counts.observe(index.assign(warm, nprobe).cluster_ids)
    hot = hottest_first(index.access_counts.snapshot())
    if args.scan:
        compare_scans(res, index, q, hot, args, device)
        if not args.skip_exhaustive:
            exhaustive(res, x, q, args, device)
        logger.info("done: %s", args.out)
        return 0
    check = q[: min(args.check_queries, len(q))]
    refs = {}
    index.drop_gpu_tier()
    if args.skip_cpu:
        args.cpu_scan_threads = args.cpu_scan_threads[:1]
        index.set_gpu_tier(1 << 40, device=device, clusters=range(args.nlist))
    for nprobe in args.nprobe:
        refs[nprobe] = cpu_baseline(res, index, q, check, nprobe, args)
    if args.cpu_only:
        logger.info("done: %s", args.out)
        return 0
    for cov in args.coverage:
        if cov == 0:
            continue
        num = int(round(cov / 100 * args.nlist))
        t0 = time.perf_counter()
        tier = index.set_gpu_tier(1 << 40, device=device, clusters=hot[:num].tolist())
        load_s = time.perf_counter() - t0
        for nprobe in args.nprobe:
            found = index.search(check, args.topk, nprobe).ids
            batches = [*args.batch, args.peak_batch] if cov == 100 else args.batch
            for batch in batches:
                stats = timed(
                    lambda b, n=nprobe: index.search(b, args.topk, n),
                    q,
                    batch,
                    args.min_seconds,
                    args.max_batches,
                )
                res.add(
                    system="gpu_tier",
                    dtype="float32",
                    nprobe=nprobe,
                    coverage=cov,
                    num_clusters=num,
                    tier_bytes=tier.num_bytes,
                    load_seconds=load_s,
                    probe_hit_rate=tier.hit_rate,
                    exact_ids=exact_share(found, refs[nprobe]),
                    **stats,
                )
    index.set_gpu_tier(1 << 40, device=device, clusters=range(args.nlist), dtype="float16")
    for nprobe in args.nprobe:
        found = index.search(check, args.topk, nprobe).ids
        stats = timed(
            lambda b, n=nprobe: index.search(b, args.topk, n),
            q,
            args.batch[0],
            args.min_seconds,
            args.max_batches,
        )
        res.add(
            system="gpu_tier",
            dtype="float16",
            nprobe=nprobe,
            coverage=100.0,
            recall_vs_float32=recall(found, refs[nprobe]),
            **stats,
        )
    index.drop_gpu_tier()
    if torch.cuda.is_available() and not args.skip_exhaustive:
        exhaustive(res, x, q, args)
    logger.info("done: %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
