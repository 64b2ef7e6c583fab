"""``ragserve profile-memory``: measure HedraRAG Eq. 2's profiles on this machine (``T_G``:
requests/s of an engine per KV size; ``T_R``: requests/s of query batches per GPU tier size)
and write the file ``ragserve serve --gpu-index-profile`` reads; model, index and engine
settings are serve's."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ragserve.cli.errors import UsageError
from ragserve.cli.options import add_server_args

KV_MULTIPLES = (1, 4, 16, 64, 256)  # requests' worth of KV blocks in the default grid
TIER_FRACTIONS = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # of the whole index, default grid


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile-memory",
        help="measure Eq. 2's profiles (decode throughput vs KV, retrieval vs GPU tier size)",
        description=__doc__.splitlines()[0],
    )
    add_server_args(p)
    p.add_argument("--out", required=True, help="profile JSON to write")
    grid = "(default: 1 to 256 requests' worth)"
    p.add_argument("--kv-blocks", type=int, nargs="+", help=f"KV sizes, blocks {grid}")
    grid = "(default: 0 to all of the index)"
    p.add_argument("--tier-gb", type=float, nargs="+", help=f"tier sizes, GB {grid}")
    p.add_argument("--tier-device", default="cuda", help="GPU tier device (cuda, cuda:N, cpu)")
    total = "memory for the KV cache and the tier, GB (default on CUDA: the free memory)"
    p.add_argument("--gpu-memory-gb", type=float, help=total)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=256, help="most requests per KV size")
    p.add_argument("--batch", type=int, default=32, help="retrieval batch size")
    p.add_argument("--retrievals-per-request", type=float, default=1.0)
    p.add_argument("--questions", help="file of queries, one a line")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from ragserve.cli.launch_config import from_args
    from ragserve.cli.options import resolve_index
    from ragserve.retrieval import VectorIndex
    from ragserve.runtime.memory_plan import (
        GenerationWorkload,
        kv_block_bytes,
        measure_generation_profile,
        measure_retrieval_profile,
        write_profile,
    )

    config = from_args(args)
    engine = dict(config.runtime.engine_kwargs)
    engine.pop("kv_cache_bytes", None)  # NOTE: the profile sets it, point by point
    for flag in ("requests", "batch", "prompt_tokens", "output_tokens", "gpu_memory_gb"):
        if (value := getattr(args, flag)) is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    work = GenerationWorkload(args.prompt_tokens, args.output_tokens, args.requests)
    block_bytes = kv_block_bytes(config.model, engine)
    given = None if args.gpu_memory_gb is None else int(args.gpu_memory_gb * 1e9)
    free = None if given is not None else _free_bytes(engine)
    block_size = int(engine.get("block_size", 16))
    kv_blocks = args.kv_blocks or _kv_grid(work, block_size, given or free, block_bytes)
    index = VectorIndex.load(resolve_index(config.index))
    try:
        queries = index.embedder.encode(_questions(args), is_query=True)
        t0 = time.time()
        gen, gen_rows = measure_generation_profile(config.model, engine, kv_blocks, work)
        total = given if free is None else free - gen_rows[0]["weight_bytes"]
        ret, ret_rows = measure_retrieval_profile(
            index,
            queries,
            _tier_grid(args, index, total),
            device=args.tier_device,
            batch_size=args.batch,
            nprobe=config.runtime.default_nprobe,
            retrievals_per_request=args.retrievals_per_request,
        )
    finally:
        index.close()
    meta = {
        "model": str(config.model),
        "index": str(config.index),
        "engine_kwargs": {k: str(v) for k, v in engine.items()},
        "workload": {
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "requests": work.num_requests,
            "batch": args.batch,
            "retrievals_per_request": args.retrievals_per_request,
        },  # fmt: skip
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
        "seconds": time.time() - t0,
        "generation": gen_rows,
        "retrieval": ret_rows,
    }
    out = write_profile(
        args.out, gen, ret, gpu_memory_bytes=total, kv_block_bytes=block_bytes, meta=meta
    )
    print(f"wrote {out}: T_G at {len(gen.sizes)} KV sizes, T_R at {len(ret.sizes)} tier sizes")
    return 0


def _free_bytes(engine: dict) -> int | None:
    """Free memory on the engine's CUDA device (before any engine is built); ``None`` on a
    CPU device (then the total is ``--gpu-memory-gb`` or unknown)."""
    import torch

    device = str(engine.get("device", "auto"))
    if device == "cpu" or not torch.cuda.is_available():
        return None
    from ragserve.runtime.memory_plan import free_gpu_bytes

    return free_gpu_bytes("cuda" if device == "auto" else device)


def _kv_grid(work: Any, block_size: int, total: int | None, block_bytes: int) -> list[int]:
    per_request = -(-work.tokens // block_size)
    grid = [per_request * m for m in KV_MULTIPLES]
    if total is not None:
        grid = [n for n in grid if n * block_bytes <= total] or [per_request]
    return grid


def _tier_grid(args: argparse.Namespace, index: Any, total: int | None) -> list[int]:
    if args.tier_gb is not None:
        if min(args.tier_gb) < 0:
            raise UsageError(f"--tier-gb must be >= 0, got {args.tier_gb}")
        return [int(g * 1e9) for g in args.tier_gb]
    from ragserve.retrieval.gpu_tier import tier_list_bytes

    whole = int(tier_list_bytes(index.cluster_sizes(), index.spec.dim).sum())  # float32 rows
    cap = whole if total is None else min(whole, total)
    return sorted({int(f * cap) for f in TIER_FRACTIONS})


def _questions(args: argparse.Namespace) -> list[str]:
    if args.questions is None:
        topics = ("history", "geography", "economy", "science", "music", "sport", "law", "art")
        return [f"Question {i}: what is known about {topics[i % 8]} item {i}?" for i in range(512)]
    try:
        lines = Path(args.questions).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"--questions: cannot read {args.questions}: {exc.strerror}") from None
    qs = [line.strip() for line in lines if line.strip()]
    if len(qs) < args.batch:
        raise UsageError(f"--questions: {len(qs)} queries, fewer than --batch {args.batch}")
    return qs
