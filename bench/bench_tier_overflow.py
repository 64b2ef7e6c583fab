"""A corpus larger than the GPU tier's budget (issue 10): VectorLiteRAG's latency model,
predicted vs measured p90 retrieval latency at the partitioner's coverage (and others), and
the SLO-bound query rate with the tier vs CPU-only Faiss. Retrieval alone, one process.

    OMP_NUM_THREADS=14 python bench/bench_tier_overflow.py --num-docs 20000000 --dim 768 \
        --nlist 16384 --topics 65536 --nprobe 256 --budget-gb 24 --out $OUT/overflow.json

Phases, each written to ``--out`` as it ends (a cut-off run keeps what it measured; a failed
phase is recorded with its error and the next one runs):

1. build: vectors generated on the tier device and kept there (never a second host copy),
   torch k-means + assignment, then handed to Faiss list by list at their final sizes (host
   memory: the lists alone, about 61 GB at 20M x 768);
2. model: ``measure_cpu_model`` (T_CQ, T_LUT by batch size, no tier), access counts and
   ``sigma_max^2`` from a calibration sample of queries;
3. budget: ``--budget-gb``, or HedraRAG Eq. 2 from a ``ragserve profile-memory`` file
   (its measured generation profile and memory, the retrieval profile modelled on this
   corpus); with both, the stated budget is used and Eq. 2's split recorded beside it;
4. partition: ``set_gpu_tier`` with Algorithm 1 as its placement (the serving path); its plan
   holds the batch size ``B`` and the predicted Eq. 1 seconds;
5. latency: at the plan's coverage and at ``--coverage`` (% of lists, hottest first, within
   the budget), closed-loop batches of ``B`` queries: measured p50/p90 next to the model's
   prediction (Eq. 1 at the Beta tail hit rate, and at the mean hit rate), the measured mean
   batch-minimum hit rate, and identical ids vs CPU-only; CPU-only at ``B`` too;
6. rate: the SLO-bound query rate, open loop: Poisson arrivals, one dispatcher that takes
   every query waiting (at most ``--max-batch``) as one batch; a rate is sustained when
   >= 95 % of the offered rate completes in the window and >= 90 % of its queries finish
   within ``--slo-search`` (``sustained.py``); geometric bisection from a start bracket
   (widened while it misses) until the highest sustained and lowest unsustained rates are
   within ``--rate-tol`` or ``--rate-points`` run out; the bound is ``"="`` only in the first
   case, else ``">="`` (a lower bound) or ``"<"``; CPU-only and with the plan's tier;
7. stream (unless skipped): the plan's tier with the cold lists streamed from host memory
   (``stream_cold="on"``, ``cold_stream``; its cost model calibrated first), in the latency
   phase (measured p90 next to Eq. 1 with streaming, ``StreamedLatencyModel``; Algorithm 1
   re-run with that model, ``partition_streamed``) and as a third SLO-bound rate. The
   tier-only rows run with ``stream_cold="off"``. Unless ``--skip stream_omp``, the latency
   phase also times the split of a cost model calibrated assuming Faiss's OpenMP threads (the
   2026-12-01 run's; ``gpu_tier_stream_omp``), each row with its prediction before timing,
   the balanced split's beside it, and the measured share of cold probes streamed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench_gpu_tier import Results, exact_share, make_queries, timed
from sustained import find_capacity, window_stats

logger = logging.getLogger("bench_tier_overflow")

LIST_BLOCK_ROWS = 1 << 20  # rows handed to Faiss per device-to-host copy


def generate(spec: Any, num_docs: int, device: str) -> Any:
    """``[num_docs, dim]`` float32 unit vectors on ``device`` (topics uniform, as
    ``synthetic_corpus``: topic center + Gaussian noise, normalised), drawn in chunks."""
    import torch

    dev = torch.device(device)
    topics = np.random.default_rng(spec.seed + 1).integers(0, spec.num_topics, num_docs)
    x = torch.empty((num_docs, spec.dim), dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
    centers = torch.from_numpy(spec.centers()).to(dev)
    scale = spec.doc_noise / math.sqrt(spec.dim)
    rows = 1 << 18
    with torch.no_grad():
        for a in range(0, num_docs, rows):
            v = x[a : a + rows]
            torch.randn(v.shape, generator=gen, device=dev, out=v)
            v.mul_(scale).add_(centers[torch.from_numpy(topics[a : a + rows]).to(dev)])
            v.div_(v.norm(dim=1, keepdim=True))
    return x


def build_index(args: argparse.Namespace, device: str) -> tuple[Any, Any, dict]:
    """An in-memory IVF-Flat IP ``VectorIndex`` (search only: no document rows) built from
    vectors that live on ``device``; ids are row + 1."""
    import faiss
    import torch

    from ragserve.retrieval import gpu_kmeans, stepwise
    from ragserve.retrieval.docstore import DocStore
    from ragserve.retrieval.index import IndexSpec, VectorIndex
    from ragserve.retrieval.synthetic import SyntheticSpec

    seconds: dict[str, float] = {}
    spec = SyntheticSpec(dim=args.dim, num_topics=args.topics, zipf_a=args.zipf)
    t0 = time.perf_counter()
    x = generate(spec, args.num_docs, device)
    seconds["generate"] = _lap(t0)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    n_train = min(args.num_docs, args.train_per_list * args.nlist)
    pick = torch.from_numpy(np.sort(rng.choice(args.num_docs, n_train, replace=False)))
    sample = x[pick.to(x.device)].cpu().numpy()
    centroids = gpu_kmeans.kmeans(sample, args.nlist, "ip", device=device, seed=0)
    del sample
    c = torch.from_numpy(centroids).to(x.device)
    labels = torch.empty(args.num_docs, dtype=torch.int64, device=x.device)
    with gpu_kmeans.exact_fp32(), torch.no_grad():
        for a in range(0, args.num_docs, gpu_kmeans.CHUNK_ROWS):
            rows = slice(a, a + gpu_kmeans.CHUNK_ROWS)
            labels[rows] = (x[rows] @ c.T).argmax(1)
    seconds["kmeans_assign"] = _lap(t0)
    t0 = time.perf_counter()
    index = stepwise.make_ivf(args.dim, args.nlist, "ivf_flat", "ip")
    index.quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    index.is_trained = True
    _add_by_list(index, x, labels, faiss)
    seconds["add"] = _lap(t0)
    del x, labels, c
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ispec = IndexSpec(args.dim, args.nlist, "ivf_flat", "ip", spec.name, args.nprobe)
    return VectorIndex(index, DocStore(None), ispec), spec, seconds


def _add_by_list(index: Any, x: Any, labels: Any, faiss: Any) -> None:
    """Every row into its list, lists in order and each list written once at its final size
    (no vector regrowth: Faiss's lists would otherwise hold up to twice their bytes)."""
    import torch

    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels, minlength=index.nlist).cpu().numpy()
    bounds = np.concatenate([[0], np.cumsum(counts)])
    invlists = index.invlists
    c0 = 0
    while c0 < index.nlist:
        c1 = int(np.searchsorted(bounds, bounds[c0] + LIST_BLOCK_ROWS, side="right")) - 1
        c1 = max(c1, c0 + 1)
        rows = order[bounds[c0] : bounds[c1]]
        block = np.ascontiguousarray(x[rows].cpu().numpy())
        ids = rows.cpu().numpy().astype(np.int64) + 1
        for c in range(c0, c1):
            a, b = bounds[c] - bounds[c0], bounds[c + 1] - bounds[c0]
            if b > a:
                codes = block[a:b].view(np.uint8)
                invlists.add_entries(c, int(b - a), faiss.swig_ptr(ids[a:b]), faiss.swig_ptr(codes))
        c0 = c1
    index.ntotal = int(bounds[-1])


def _lap(t0: float) -> float:
    return time.perf_counter() - t0


def serve_open_loop(
    search: Callable[[np.ndarray], Any],
    queries: np.ndarray,
    arrivals: np.ndarray,
    *,
    max_batch: int,
    timeout: float,
) -> np.ndarray:
    """Finish offsets (seconds from the start; ``nan``: not served) of queries arriving at
    ``arrivals`` (ascending offsets): one dispatcher takes every arrived query, at most
    ``max_batch``, as one batch; it stops ``timeout`` s after the last arrival."""
    n = len(arrivals)
    finish = np.full(n, np.nan)
    start = time.monotonic()
    i = 0
    while i < n:
        now = time.monotonic() - start
        if now > arrivals[-1] + timeout:
            break
        if arrivals[i] > now:
            time.sleep(min(arrivals[i] - now, 0.05))
            continue
        j = min(int(np.searchsorted(arrivals, now, side="right")), i + max_batch)
        search(queries[np.arange(i, j) % len(queries)])
        finish[i:j] = time.monotonic() - start
        i = j
    return finish


def rate_point(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, rate: float, args: Any
) -> dict:
    """One open-loop point at ``rate`` queries/s: ``warmup + window`` s of Poisson arrivals
    (at most ``--rate-queries``), judged by ``sustained.py``'s window statistics."""
    rng = np.random.default_rng(int(rate * 1000) + 7)
    n = min(args.rate_queries, int(math.ceil(rate * (args.rate_warmup + args.rate_window))))
    n = max(3, n, args.rate_min_queries)  # NOTE: the sustained method's >= 200 requests
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    finish = serve_open_loop(
        search, queries, arrivals, max_batch=args.max_batch, timeout=args.slo_search
    )
    served = ~np.isnan(finish)
    latency = np.where(served, finish - arrivals, np.inf)
    responses = [
        SimpleNamespace(error=None if ok else "timeout", finish_time=f, latency=lat)
        for ok, f, lat in zip(served, np.nan_to_num(finish, nan=-1.0), latency, strict=True)
    ]
    warm = min(args.rate_warmup, float(arrivals[len(arrivals) // 4]))
    stats = window_stats(responses, arrivals, 0.0, warm, args.slo_search)
    done = latency[np.isfinite(latency)]
    p90 = float(np.percentile(latency, 90))
    stats.update(
        rate=rate,
        num_queries=n,
        served=int(served.sum()),
        p50_s=float(np.percentile(done, 50)) if len(done) else None,
        p90_s=p90 if math.isfinite(p90) else None,
    )
    logger.info("rate point %s", stats)
    return stats


def slo_rate(
    search: Callable[[np.ndarray], Any],
    queries: np.ndarray,
    lo: float,
    hi: float,
    args: Any,
    record: Callable[[dict], None] = lambda point: None,
) -> dict:
    """The highest sustained open-loop rate from the bracket ``[lo, hi]`` (``find_capacity``);
    ``record`` gets each point's statistics as it is measured (a cut-off run keeps them)."""

    def measure(rate: float) -> dict:
        stats = rate_point(search, queries, rate, args)
        record(stats)
        return stats

    cap = find_capacity(
        measure,
        lo,
        hi,
        rel_tol=args.rate_tol,
        max_points=args.rate_points,
        expand=True,
    )
    return {
        "capacity_qps": cap.rate,
        "bound": cap.bound,
        "first_unsustained_qps": cap.upper,
        "points": [{"rate": r, "sustained": ok, **st} for r, ok, st in cap.points],
    }


class Phases:
    """Runs named phases in order; a failure is recorded (type, message, traceback tail) and
    the run goes on with the next phase that does not need the failed one's result."""

    def __init__(self, res: Results) -> None:
        self.res = res
        self.failed: set[str] = set()
        self.res.doc.setdefault("failures", [])

    def run(self, name: str, fn: Callable[[], Any], *, needs: tuple[str, ...] = ()) -> Any:
        missing = [n for n in needs if n in self.failed]
        if missing:
            self.failed.add(name)
            self.res.doc["failures"].append({"phase": name, "skipped": f"needs {missing}"})
            self.res.save()
            return None
        logger.info("phase %s", name)
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a bench records the failure and goes on
            self.failed.add(name)
            self.res.doc["failures"].append(
                {
                    "phase": name,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
            self.res.save()
            logger.exception("phase %s failed", name)
            return None
        self.res.doc.setdefault("phase_seconds", {})[name] = time.perf_counter() - t0
        self.res.save()
        return out


def eq2_budget(
    path: Path, model: Any, counts: np.ndarray, cbytes: np.ndarray, sigma2: float, batch: int
) -> dict:
    """HedraRAG Eq. 2's tier bytes: the profile file's measured ``generation_profile`` and its
    ``gpu_memory_bytes`` / ``kv_block_bytes``, ``T_R`` modelled on this corpus."""
    import json

    from ragserve.scheduler.memory_split import (
        ThroughputProfile,
        modelled_retrieval_profile,
        solve_memory_split,
    )

    data = json.loads(Path(path).read_text())
    for key in ("generation_profile", "gpu_memory_bytes", "kv_block_bytes"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r} (write it with ragserve profile-memory)")
    sizes, rps = zip(*data["generation_profile"], strict=True)
    gen = ThroughputProfile(tuple(map(float, sizes)), tuple(map(float, rps)))
    total = int(data["gpu_memory_bytes"])
    index_bytes = int(cbytes.sum())
    grid = sorted({int(f * min(total, index_bytes)) for f in np.linspace(0, 1, 33)})
    ret = modelled_retrieval_profile(model, counts, cbytes, sigma2, grid, batch_size=batch)
    split = solve_memory_split(
        total, int(data["kv_block_bytes"]), gen, ret, max_index_bytes=index_bytes
    )
    return {
        "source": "eq2",
        "budget_bytes": split.index_tier_bytes,
        "kv_cache_bytes": split.kv_cache_bytes,
        "num_kv_blocks": split.num_kv_blocks,
        "generation_rps": split.generation_rps,
        "retrieval_rps": split.retrieval_rps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--num-docs", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--topics", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--train-per-list", type=int, default=64, help="k-means sample per list")
    ap.add_argument("--nprobe", type=int, default=256)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--budget-gb", type=float, default=None, help="stated tier budget (GB)")
    ap.add_argument(
        "--eq2-profile",
        type=Path,
        default=None,
        help="profile-memory JSON: the budget from Eq. 2 instead",
    )
    ap.add_argument("--slo-search", type=float, default=2.0, help="retrieval SLO, seconds")
    ap.add_argument(
        "--llm-rate",
        type=float,
        default=48.0,
        help="mu_LLM0: LLM queries/s to the retriever (Algorithm 1)",
    )
    ap.add_argument(
        "--coverage",
        type=float,
        nargs="*",
        default=[10.0, 25.0],
        help="other coverages (%% of lists, hottest first) to measure",
    )
    ap.add_argument("--model-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--model-repeats", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument(
        "--latency-seconds",
        type=float,
        default=15.0,
        help="timing per point of the predicted-vs-measured phase (p90 needs several batches)",
    )
    ap.add_argument("--max-batches", type=int, default=40)
    ap.add_argument("--max-batch", type=int, default=64, help="open loop: most queries a batch")
    ap.add_argument("--rate-warmup", type=float, default=2.0)
    ap.add_argument("--rate-window", type=float, default=10.0)
    ap.add_argument("--rate-queries", type=int, default=2000, help="most queries per rate point")
    ap.add_argument("--rate-points", type=int, default=4, help="most rate points a system")
    ap.add_argument(
        "--rate-tol", type=float, default=0.1, help="bisect until hi/lo <= 1 + this ('=')"
    )
    ap.add_argument(
        "--rate-min-queries",
        type=int,
        default=0,
        help="at least this many queries a rate point (the window grows at low rates)",
    )
    ap.add_argument(
        "--cpu-rate",
        type=float,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="CPU-only bisection bracket (default: from the model)",
    )
    ap.add_argument("--tier-rate", type=float, nargs=2, default=None, metavar=("LO", "HI"))
    ap.add_argument("--stream-rate", type=float, nargs=2, default=None, metavar=("LO", "HI"))
    ap.add_argument(
        "--stream-host-gb", type=float, default=1.0, help="pinned bounce buffers of the stream"
    )
    ap.add_argument(
        "--rate-order",
        nargs="+",
        default=["cpu", "tier", "stream"],
        choices=["cpu", "tier", "stream"],
        help="order of the SLO-bound rate phases (a run cut off keeps the first ones; without "
        "explicit brackets, tier's and stream's come from the rates measured before them)",
    )
    ap.add_argument(
        "--rate-placement",
        choices=["plan", "fill"],
        default="plan",
        help="the tier's lists in the rate phases: Algorithm 1's plan, or the budget filled "
        "hottest-first",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["latency", "cpu_rate", "tier_rate", "stream", "stream_rate", "stream_omp"],
    )
    ap.add_argument("--device", default=None, help="build and tier device (default cuda if any)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/tier_overflow.json"))
    args = ap.parse_args(argv)
    if args.budget_gb is None and args.eq2_profile is None:
        ap.error("give --budget-gb, --eq2-profile or both (then Eq. 2's split is recorded)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    import faiss
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "faiss_threads": faiss.omp_get_max_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    res = Results(args.out, meta)
    run = Phases(res)
    st: dict[str, Any] = {}

    def build() -> None:
        st["index"], st["spec"], secs = build_index(args, device)
        from ragserve.retrieval.gpu_tier import tier_list_bytes

        sizes = st["index"].cluster_sizes()
        st["cbytes"] = tier_list_bytes(sizes, args.dim)  # NOTE: priced as the tier allocates
        res.doc["build"] = {
            "seconds": secs,
            "index_bytes": int(st["index"].cluster_cost_bytes().sum()),
            "tier_bytes_all_lists": int(st["cbytes"].sum()),
            "list_size_max": int(sizes.max()),
            "list_size_mean": float(sizes.mean()),
        }

    def model() -> None:
        from ragserve.retrieval.latency_model import measure_cpu_model
        from ragserve.retrieval.partition import count_accesses, profile_max_variance

        index = st["index"]
        st["q"] = make_queries(st["spec"], 4096, seed=1)
        calib = make_queries(st["spec"], 2048, seed=2)
        probes = index.assign(calib, args.nprobe).cluster_ids
        st["calib_probes"] = probes
        st["counts"] = count_accesses(probes, args.nlist).astype(np.float64)
        index.access_counts.observe(probes)
        st["sigma2"] = profile_max_variance(probes, args.nlist)
        st["model"] = measure_cpu_model(
            index,
            st["q"],
            args.nprobe,
            batch_sizes=args.model_batches,
            topk=args.topk,
            repeats=args.model_repeats,
        )
        res.doc["model"] = {
            "latency_model": json_of(st["model"]),
            "max_variance": st["sigma2"],
            "cpu_seconds": {b: st["model"].cpu_seconds(b) for b in args.model_batches},
        }

    def budget() -> None:
        if args.eq2_profile is not None:
            batch = max(1, math.ceil(args.slo_search / 2 * args.llm_rate))
            res.doc["eq2"] = eq2_budget(
                args.eq2_profile, st["model"], st["counts"], st["cbytes"], st["sigma2"], batch
            )
            res.doc["budget"] = dict(res.doc["eq2"])
        if args.budget_gb is not None:  # NOTE: a stated budget wins; Eq. 2's stays recorded
            res.doc["budget"] = {"source": "stated", "budget_bytes": int(args.budget_gb * 1e9)}
        st["budget"] = int(res.doc["budget"]["budget_bytes"])
        res.doc["budget"]["share_of_index"] = st["budget"] / max(1, int(st["cbytes"].sum()))

    def place() -> None:
        from ragserve.retrieval.partition import PartitionConfig
        from ragserve.retrieval.tier_placement import PlacementConfig

        config = PartitionConfig(
            slo_seconds=args.slo_search,
            throughput=args.llm_rate,
            max_variance=st["sigma2"],
            budget_bytes=st["budget"],
        )
        st["partition_config"] = config
        placement = PlacementConfig(latency_model=st["model"], partition=config)
        t0 = time.perf_counter()
        st["index"].set_gpu_tier(
            st["budget"], device=device, placement=placement, stream_cold="off"
        )
        load = time.perf_counter() - t0
        plan = st["index"].tier_updater.plan
        st["plan"] = plan
        st["index"].drop_gpu_tier()  # re-placed pinned below: no background swaps mid-timing
        res.doc["partition"] = {
            "num_clusters": len(plan.cluster_ids),
            "coverage": plan.coverage,
            "num_bytes": plan.num_bytes,
            "hit_rate": plan.hit_rate,
            "tail_hit_rate": plan.tail_hit_rate,
            "batch_size": plan.batch_size,
            "predicted_s": plan.predicted_seconds,
            "target_s": plan.target_seconds,
            "meets_slo": plan.meets_slo,
            "load_seconds": load,
        }

    def latency() -> None:
        from ragserve.retrieval.partition import (
            BetaHitRate,
            fill_budget,
            hottest_first,
            per_query_hit_rates,
        )

        index, q, plan, mdl = st["index"], st["q"], st["plan"], st["model"]
        batch = int(plan.batch_size)
        # NOTE: the partitioner's own clusters (picked on the index's live access counts, which
        # the model phase's searches moved) and, for the other coverages, hottest-first prefixes
        # of the calibration counts that fit the budget at the tier's chunk prices
        order = hottest_first(st["counts"])
        fit = len(fill_budget(st["counts"], st["cbytes"], st["budget"]).cluster_ids)
        sets = {len(plan.cluster_ids): np.asarray(plan.cluster_ids, dtype=np.int64)}
        for c in args.coverage:
            k = min(fit, int(round(c / 100 * args.nlist)))
            sets.setdefault(k, order[:k])
        check = q[:64]
        ref = index.search(check, args.topk, args.nprobe).ids
        cpu = timed(
            lambda b: index.search(b, args.topk, args.nprobe),
            q,
            batch,
            args.latency_seconds,
            args.max_batches,
        )
        res.add(system="cpu_faiss", batch=batch, predicted_s=mdl.cpu_seconds(batch), **_drop(cpu))
        probes = index.assign(q, args.nprobe).cluster_ids
        for k, clusters in sorted(sets.items()):
            index.set_gpu_tier(
                st["budget"], device=device, clusters=clusters.tolist(), stream_cold="off"
            )
            found = index.search(check, args.topk, args.nprobe).ids
            stats = timed(
                lambda b: index.search(b, args.topk, args.nprobe),
                q,
                batch,
                args.latency_seconds,
                args.max_batches,
            )
            on = np.zeros(args.nlist, dtype=bool)
            on[clusters] = True
            rates = per_query_hit_rates(probes, on)
            nb = len(rates) // batch
            batches = rates[: nb * batch].reshape(nb, batch) if nb else rates[:1].reshape(1, 1)
            mean = float(st["counts"][clusters].sum() / st["counts"].sum())
            dist = BetaHitRate.from_mean(mean, st["sigma2"])
            tail = dist.tail(batch, "batch_mean", 0.1)
            tail_min = dist.tail(batch, "min")
            pred = mdl.hybrid_seconds(batch, min(max(tail, 0.0), 1.0))
            pred_min = mdl.hybrid_seconds(batch, min(max(tail_min, 0.0), 1.0))
            res.add(
                system="gpu_tier",
                partitioner_choice=clusters is sets[len(plan.cluster_ids)],
                num_clusters=k,
                coverage=k / args.nlist,
                batch=batch,
                hit_rate_model=mean,
                hit_rate_measured=float(rates.mean()),
                tail_hit_rate_model=tail,
                tail_hit_rate_measured=float(np.quantile(batches.mean(1), 0.1)),
                min_hit_rate_model=tail_min,
                min_hit_rate_measured=float(batches.min(1).mean()),
                predicted_s=pred,
                predicted_min_s=pred_min,
                predicted_mean_hit_s=mdl.hybrid_seconds(batch, min(mean, 1.0)),
                p90_error=(pred - stats["p90_s"]) / stats["p90_s"],
                p90_error_min=(pred_min - stats["p90_s"]) / stats["p90_s"],
                exact_ids=exact_share(found, ref),
                **_drop(stats),
            )
        index.drop_gpu_tier()
        if "stream" not in args.skip:
            stream_latency(batch, check, ref)

    def rate_clusters() -> list[int]:
        """The tier's lists in the rate phases: the plan's (Algorithm 1 at ``--llm-rate``), or
        with ``--rate-placement fill`` the hottest lists that fill the budget at the tier's
        chunk prices (a plan that needs no tier at the LLM's rate still has a budget to use)."""
        if args.rate_placement == "plan":
            return list(st["plan"].cluster_ids)
        from ragserve.retrieval.partition import fill_budget

        got = fill_budget(st["counts"], st["cbytes"], st["budget"])
        res.doc["rate_placement"] = {"mode": "fill", "num_clusters": len(got.cluster_ids)}
        return [int(c) for c in got.cluster_ids]

    def place_streamed(clusters: list[int] | None = None) -> Any:
        """The plan's tier (or ``clusters``) with streaming on and its cost model calibrated
        (once: the same placement reuses it); the model."""
        from ragserve.retrieval.cold_stream import StreamConfig

        stream = StreamConfig(mode="on", host_budget_bytes=int(args.stream_host_gb * 1e9))
        if clusters is None:
            clusters = list(st["plan"].cluster_ids)
        st["index"].set_gpu_tier(st["budget"], device=device, clusters=clusters, stream_cold=stream)
        if st.get("stream_cost") is not None:
            st["index"].gpu_tier.streamer.model = st["stream_cost"]
            return st["stream_cost"]
        t0 = time.perf_counter()
        st["stream_cost"] = cost = st["index"].calibrate_stream()
        res.doc["stream_calibration_s"] = time.perf_counter() - t0
        return cost

    def algorithm_1_streamed(streamed: Any) -> None:
        """Algorithm 1 again with Eq. 1 priced with streaming (offline: the model only)."""
        from ragserve.retrieval.partition import partition

        got = partition(streamed, st["counts"], st["cbytes"], st["partition_config"])
        res.doc["partition_streamed"] = {
            "num_clusters": len(got.cluster_ids),
            "coverage": got.coverage,
            "num_bytes": got.num_bytes,
            "hit_rate": got.hit_rate,
            "batch_size": got.batch_size,
            "predicted_s": got.predicted_seconds,
            "meets_slo": got.meets_slo,
        }

    def stream_latency(batch: int, check: np.ndarray, ref: np.ndarray) -> None:
        """The streamed tier at ``B``: the split by the calibrated cost model (the CPU scan's
        real parallelism), and, unless skipped, by one calibrated assuming Faiss's OpenMP
        threads (``gpu_tier_stream_omp``: the 2026-12-01 run's split). Each predicted before
        it is timed (Eq. 1 with the router's split, and with a balanced one)."""
        from ragserve.retrieval.index_tier import scan_threads

        cost = place_streamed()
        streamed = streamed_model(st, st["plan"], cost, batch, args.dim)
        st["streamed_model"] = streamed
        algorithm_1_streamed(streamed)
        stream_point("gpu_tier_stream", cost, batch, check, ref)
        omp = max(1, faiss_threads())
        if "stream_omp" not in args.skip and omp != scan_threads(st["index"]._index):
            old = st["index"].calibrate_stream(threads=omp)
            stream_point("gpu_tier_stream_omp", old, batch, check, ref)
        st["index"].drop_gpu_tier()

    def stream_point(system: str, cost: Any, batch: int, check: np.ndarray, ref: np.ndarray):
        from ragserve.retrieval.partition import BetaHitRate

        index, q, plan = st["index"], st["q"], st["plan"]
        streamed = streamed_model(st, plan, cost, batch, args.dim)
        balanced = dataclasses.replace(streamed, split=None)
        mean = float(plan.hit_rate)
        tail = BetaHitRate.from_mean(mean, st["sigma2"]).tail(batch, "batch_mean", 0.1)
        eta = min(max(tail, 0.0), 1.0)
        pred, pred_balanced = (
            streamed.hybrid_seconds(batch, eta),
            balanced.hybrid_seconds(batch, eta),
        )
        share = float(streamed.streamed_shares(np.asarray([batch]), np.asarray([1 - mean]))[0])
        found = index.search(check, args.topk, args.nprobe).ids
        streamer = index.gpu_tier.streamer
        streamer.reset_counts()
        stats = timed(
            lambda b: index.search(b, args.topk, args.nprobe),
            q,
            batch,
            args.latency_seconds,
            args.max_batches,
        )
        res.add(
            system=system,
            num_clusters=len(plan.cluster_ids),
            coverage=len(plan.cluster_ids) / args.nlist,
            batch=batch,
            hit_rate_model=mean,
            tail_hit_rate_model=tail,
            predicted_s=pred,
            predicted_balanced_s=pred_balanced,
            predicted_mean_hit_s=streamed.hybrid_seconds(batch, min(mean, 1.0)),
            predicted_no_stream_s=st["model"].hybrid_seconds(batch, eta),
            p90_error=(pred - stats["p90_s"]) / stats["p90_s"],
            p90_error_balanced=(pred_balanced - stats["p90_s"]) / stats["p90_s"],
            exact_ids=exact_share(found, ref),
            stream_cost_model=dataclasses.asdict(cost) if cost is not None else None,
            streamed_model={
                "fixed_s": streamed.stream.fixed_s,
                "s_per_byte": streamed.stream.s_per_byte,
                "bytes_per_probe": streamed.bytes_per_probe,
                "distinct_share": streamed.distinct_share,
                "split": None if streamed.split is None else dataclasses.asdict(streamed.split),
            },
            streamed_probe_share_model=share / max(1 - mean, 1e-12),
            streamed_probe_share_measured=streamer.num_streamed_probes
            / max(streamer.num_cold_probes, 1),
            streamed_batches=streamer.num_batches,
            streamed_gb=streamer.num_bytes / 1e9,
            pinned_bytes=streamer.pinned_bytes,
            **_drop(stats),
        )

    def recorder(system: str) -> Callable[[dict], None]:
        """Saves each rate point under ``rate_points_<system>`` as it is measured."""
        points = res.doc.setdefault(f"rate_points_{system}", [])

        def record(stats: dict) -> None:
            points.append(dict(stats))
            res.save()

        return record

    def cpu_rate() -> None:
        index = st["index"]
        lo, hi = args.cpu_rate or _bracket(st["model"], args)
        res.doc["slo_rate_cpu"] = slo_rate(
            lambda b: index.search(b, args.topk, args.nprobe),
            st["q"],
            lo,
            hi,
            args,
            recorder("cpu"),
        )

    def tier_rate() -> None:
        index = st["index"]
        clusters = rate_clusters()
        index.set_gpu_tier(st["budget"], device=device, clusters=clusters, stream_cold="off")
        cpu = res.doc.get("slo_rate_cpu", {}).get("capacity_qps")
        lo, hi = args.tier_rate or ((cpu or 1.0) * 1.5, (cpu or 1.0) * 8.0)
        res.doc["slo_rate_tier"] = slo_rate(
            lambda b: index.search(b, args.topk, args.nprobe),
            st["q"],
            lo,
            hi,
            args,
            recorder("tier"),
        )
        index.drop_gpu_tier()
        tier = res.doc["slo_rate_tier"]["capacity_qps"]
        if cpu and tier:
            res.doc["slo_rate_ratio"] = tier / cpu

    def stream_rate() -> None:
        index = st["index"]
        place_streamed(rate_clusters())
        cpu = res.doc.get("slo_rate_cpu", {}).get("capacity_qps")
        tier = res.doc.get("slo_rate_tier", {}).get("capacity_qps")
        base = tier or (cpu or 1.0) * 2.0
        lo, hi = args.stream_rate or (base * 0.75, base * 4.0)
        res.doc["slo_rate_stream"] = slo_rate(
            lambda b: index.search(b, args.topk, args.nprobe),
            st["q"],
            lo,
            hi,
            args,
            recorder("stream"),
        )
        streamer = index.gpu_tier.streamer
        res.doc["slo_rate_stream"]["streamed_gb"] = streamer.num_bytes / 1e9
        index.drop_gpu_tier()
        got = res.doc["slo_rate_stream"]["capacity_qps"]
        if cpu and got:
            res.doc["slo_rate_stream_ratio"] = got / cpu

    run.run("build", build)
    run.run("model", model, needs=("build",))
    run.run("budget", budget, needs=("model",))
    run.run("partition", place, needs=("budget",))
    if "latency" not in args.skip:
        run.run("latency", latency, needs=("partition",))
    rates = {
        "cpu": ("cpu_rate", cpu_rate, ("model",)),
        "tier": ("tier_rate", tier_rate, ("partition",)),
        "stream": ("stream_rate", stream_rate, ("partition",)),
    }
    for name in args.rate_order:
        phase, fn, needs = rates[name]
        if phase not in args.skip and not (name == "stream" and "stream" in args.skip):
            run.run(phase, fn, needs=needs)
    res.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res.save()
    logger.info("done: %s (failed phases: %s)", args.out, sorted(run.failed) or "none")
    return 1 if run.failed else 0


def _bracket(model: Any, args: Any) -> tuple[float, float]:
    """CPU-only bisection bracket from the model: a batch of ``max_batch`` back to back."""
    b = args.max_batch
    peak = b / max(model.cpu_seconds(b), 1e-9)
    return peak * 0.3, peak * 1.2


def faiss_threads() -> int:
    import faiss

    return int(faiss.omp_get_max_threads())


def streamed_model(st: dict, plan: Any, cost: Any, batch: int, dim: int) -> Any:
    """Eq. 1 with streaming for ``plan``: the stream side of the calibrated ``cost`` model and
    its CPU side as the router's split pricing, the access-weighted bytes of a cold probe, and
    the share of a batch's cold probes whose list is distinct (from the calibration probes, in
    batches of ``batch``)."""
    from ragserve.retrieval.latency_model import SplitPricing, StreamedLatencyModel, StreamModel

    counts, sizes = st["counts"], st["index"].cluster_sizes()
    cold = np.ones(len(counts), dtype=bool)
    cold[np.asarray(plan.cluster_ids, dtype=np.int64)] = False
    row_bytes = dim * 4 + 8
    weight = counts * cold
    per_probe = float((weight * sizes).sum() / max(weight.sum(), 1e-12)) * row_bytes
    probes = st["calib_probes"]
    shares = []
    for a in range(0, len(probes) - batch + 1, batch):
        c = probes[a : a + batch]
        c = c[(c >= 0) & cold[np.where(c >= 0, c, 0)]]
        if len(c):
            shares.append(len(np.unique(c)) / len(c))
    distinct = float(np.mean(shares)) if shares else 1.0
    if cost is None:  # nothing is streamed under no cost model
        return StreamedLatencyModel(
            st["model"], StreamModel(np.inf, 0.0), per_probe, max(distinct, 1e-6)
        )
    split = SplitPricing(cost.cpu_fixed_s, cost.cpu_s_per_row, cost.threads, per_probe / row_bytes)
    return StreamedLatencyModel(
        st["model"],
        StreamModel(cost.stream_fixed_s, cost.stream_s_per_byte),
        per_probe,
        max(distinct, 1e-6),
        split,
    )


def _drop(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "batch"}


def json_of(model: Any) -> dict:
    import json

    return json.loads(model.to_json())


if __name__ == "__main__":
    raise SystemExit(main())
