"""The overflow bench's latency phase (``bench/bench_tier_overflow.py``, phase 5 and 7's
latency rows): measured p50/p90 at the batch size ``B`` next to Eq. 1's prediction, for
CPU-only, the tier at each coverage and the streamed tier (``StreamedLatencyModel``).
Each phase function takes the run's ``args``, ``Results``, state dict and device."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

from bench_gpu_tier import Results, exact_share, timed
from tier_models import StreamedLatencyModel, per_query_hit_rates


def latency(args: argparse.Namespace, res: Results, st: dict, device: str) -> None:
    """Predicted vs measured latency at ``B``: CPU-only, the tier at each coverage, then the
    streamed tier (unless skipped)."""
    from ragserve.retrieval.partition import BetaHitRate, fill_budget, hottest_first

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
    cpu = _time_search(args, index, q, batch)
    res.add(system="cpu_faiss", batch=batch, predicted_s=mdl.cpu_seconds(batch), **_drop(cpu))
    probes = index.assign(q, args.nprobe).cluster_ids
    for k, clusters in sorted(sets.items()):
        index.set_gpu_tier(
            st["budget"], device=device, clusters=clusters.tolist(), stream_cold="off"
        )
        found = index.search(check, args.topk, args.nprobe).ids
        stats = _time_search(args, index, q, batch)
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
        stream_latency(args, res, st, device, batch, check, ref)


def place_streamed(
    args: argparse.Namespace, res: Results, st: dict, device: str, clusters: list[int] | None = None
) -> Any:
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


def algorithm_1_streamed(res: Results, st: dict, streamed: Any) -> None:
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


def stream_latency(
    args: argparse.Namespace,
    res: Results,
    st: dict,
    device: str,
    batch: int,
    check: np.ndarray,
    ref: np.ndarray,
) -> None:
    """The streamed tier at ``B``: the split by the calibrated cost model (the CPU scan's
    real parallelism), and, unless skipped, by one calibrated assuming Faiss's OpenMP
    threads (``gpu_tier_stream_omp``: the 2026-12-01 run's split). Each predicted before
    it is timed (Eq. 1 with the router's split, and with a balanced one)."""
    from ragserve.retrieval.index_tier import scan_threads

    cost = place_streamed(args, res, st, device)
    streamed = streamed_model(st, st["plan"], cost, batch, args.dim)
    st["streamed_model"] = streamed
    algorithm_1_streamed(res, st, streamed)
    stream_point(args, res, st, "gpu_tier_stream", cost, batch, check, ref)
    omp = max(1, faiss_threads())
    if "stream_omp" not in args.skip and omp != scan_threads(st["index"]._index):
        old = st["index"].calibrate_stream(threads=omp)
        stream_point(args, res, st, "gpu_tier_stream_omp", old, batch, check, ref)
    st["index"].drop_gpu_tier()


def stream_point(
    args: argparse.Namespace,
    res: Results,
    st: dict,
    system: str,
    cost: Any,
    batch: int,
    check: np.ndarray,
    ref: np.ndarray,
) -> None:
    from ragserve.retrieval.partition import BetaHitRate

    index, q, plan = st["index"], st["q"], st["plan"]
    streamed = streamed_model(st, plan, cost, batch, args.dim)
    balanced = dataclasses.replace(streamed, rows_per_probe=None)
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
    stats = _time_search(args, index, q, batch)
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
            "fixed_s": streamed.cost.stream_fixed_s,
            "s_per_byte": streamed.cost.stream_s_per_byte,
            "bytes_per_probe": streamed.bytes_per_probe,
            "distinct_share": streamed.distinct_share,
            "split": _split_of(streamed),
        },
        streamed_probe_share_model=share / max(1 - mean, 1e-12),
        streamed_probe_share_measured=streamer.num_streamed_probes
        / max(streamer.num_cold_probes, 1),
        streamed_batches=streamer.num_batches,
        streamed_gb=streamer.num_bytes / 1e9,
        pinned_bytes=streamer.pinned_bytes,
        **_drop(stats),
    )


def faiss_threads() -> int:
    import faiss

    return int(faiss.omp_get_max_threads())


def _split_of(streamed: Any) -> dict | None:
    """The router's pricing as the JSON records it (its ``split``; None: balanced)."""
    if streamed.rows_per_probe is None:
        return None
    c = streamed.cost
    return {
        "cpu_fixed_s": c.cpu_fixed_s,
        "cpu_s_per_row": c.cpu_s_per_row,
        "threads": c.threads,
        "rows_per_probe": streamed.rows_per_probe,
    }


def streamed_model(st: dict, plan: Any, cost: Any, batch: int, dim: int) -> Any:
    """Eq. 1 with streaming for ``plan``: the stream side of the calibrated ``cost`` model and
    its CPU side as the router's split pricing, the access-weighted bytes of a cold probe, and
    the share of a batch's cold probes whose list is distinct (from the calibration probes, in
    batches of ``batch``)."""
    from ragserve.retrieval.cold_stream import StreamCostModel

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
        never = StreamCostModel(0.0, 0.0, np.inf, 0.0)
        return StreamedLatencyModel(st["model"], never, per_probe, max(distinct, 1e-6))
    return StreamedLatencyModel(
        st["model"], cost, per_probe, max(distinct, 1e-6), rows_per_probe=per_probe / row_bytes
    )


def _time_search(args: argparse.Namespace, index: Any, q: np.ndarray, batch: int) -> dict:
    """Closed-loop batches of ``batch`` queries for ``--latency-seconds`` (p50/p90)."""
    return timed(
        lambda b: index.search(b, args.topk, args.nprobe),
        q,
        batch,
        args.latency_seconds,
        args.max_batches,
    )


def _drop(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "batch"}
