"""HedraRAG Eq. 2's start-up profiles, measured on this machine (``ragserve profile-memory``).

- ``T_G`` by KV blocks: for each size an ``LLMEngine`` with exactly that KV cache runs
  ``num_requests`` offline requests of ``prompt_tokens`` in, ``output_tokens`` out (EOS
  ignored), all queued at once: completed requests/s (the decode throughput the KV size allows).
- ``T_R`` by tier bytes: the index with a GPU tier of that size (hottest lists by the access
  counts of the profile's queries; 0 = no tier) serves back-to-back batches of ``batch_size``
  queries: ``batch_size / (median batch seconds * retrievals_per_request)`` requests/s.

The file (``write_profile``) is what ``serve --gpu-index-profile`` reads (``load_profiles``):
``{"generation_profile": [[kv_blocks, rps], ...], "retrieval_profile": [[bytes, rps], ...],
"gpu_memory_bytes": ..., "kv_block_bytes": ..., "meta": {...}}``.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragserve.runtime.memory_plan import kv_block_bytes
from ragserve.scheduler.memory_split import ThroughputProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationWorkload:
    """The requests ``T_G`` is measured with (token counts, not text)."""

    prompt_tokens: int = 64
    output_tokens: int = 128
    num_requests: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def measure_generation_profile(
    model: str | Path,
    engine_kwargs: dict[str, Any],
    kv_blocks: Sequence[int],
    workload: GenerationWorkload | None = None,
) -> tuple[ThroughputProfile, list[dict]]:
    """``T_G``: completed requests/s at each KV size (one engine per size, built and freed in
    turn), and one row of details per size (with the engine's ``weight_bytes``). Raises
    ``ValueError`` naming ``kv_blocks`` when a size cannot hold one request."""
    import torch

    from ragserve.generation.llm_engine import LLMEngine
    from ragserve.generation.sampling_params import SamplingParams

    work = workload or GenerationWorkload()
    block_bytes = kv_block_bytes(model, engine_kwargs)
    block_size = int(engine_kwargs.get("block_size", 16))
    sizes = _ascending("kv_blocks", kv_blocks)
    per_request = -(-work.tokens // block_size)
    if sizes[0] < per_request:
        raise ValueError(
            f"kv_blocks: {sizes[0]} blocks of {block_size} tokens cannot hold one request of "
            f"{work.tokens} tokens (needs {per_request})"
        )
    rows, rps = [], []
    for n in sizes:
        engine = LLMEngine(model, **{**engine_kwargs, "kv_cache_bytes": n * block_bytes})
        try:
            vocab = engine.model_config.vocab_size
            rng = np.random.default_rng(work.seed)
            # NOTE: enough requests to fill the KV size (x4), at most num_requests
            count = min(work.num_requests, max(4, 4 * (n // per_request)))
            prompts = rng.integers(3, vocab, (count, work.prompt_tokens)).tolist()
            params = SamplingParams(max_tokens=work.output_tokens, ignore_eos=True)
            engine.generate(prompts[:2], params)  # warm-up: allocator, kernels
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            seconds = time.perf_counter() - t0
            weights = sum(
                t.numel() * t.element_size() for t in engine.model_runner.model.parameters()
            )
        finally:
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        produced = sum(len(o.token_ids) for o in outs)
        rps.append(count / seconds)
        rows.append(
            {
                "kv_blocks": n,
                "requests": count,
                "seconds": seconds,
                "rps": count / seconds,
                "tokens_per_s": produced / seconds,
                "weight_bytes": int(weights),
            }  # fmt: skip
        )
        logger.info("T_G: %d KV blocks -> %.2f requests/s", n, count / seconds)
    return ThroughputProfile(tuple(float(s) for s in sizes), tuple(rps)), rows


def measure_retrieval_profile(
    index: Any,
    queries: np.ndarray,
    tier_bytes: Sequence[int],
    *,
    device: str = "cuda",
    batch_size: int = 32,
    nprobe: int | None = None,
    topk: int = 10,
    retrievals_per_request: float = 1.0,
    min_batches: int = 5,
) -> tuple[ThroughputProfile, list[dict]]:
    """``T_R``: requests/s at each tier size (hottest lists first by ``queries``' probes), and
    one row of details per size. The index's tier is dropped at the end."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if batch_size < 1 or len(q) < batch_size:
        raise ValueError(f"batch_size must be in [1, {len(q)}] (the queries), got {batch_size}")
    if min_batches < 1:
        raise ValueError(f"min_batches must be >= 1, got {min_batches}")
    sizes = _ascending("tier_bytes", tier_bytes, minimum=0)
    index.access_counts.observe(index.assign(q, nprobe).cluster_ids)
    rows, seconds = [], []
    try:
        for size in sizes:
            index.drop_gpu_tier()
            tier = index.set_gpu_tier(int(size), device=device) if size > 0 else None
            if tier is not None and index.tier_updater is not None:
                index.tier_updater.close()  # NOTE: a fixed placement while timing
            times = []
            for i in range(min_batches + 1):
                a = (i * batch_size) % (len(q) - batch_size + 1)
                t0 = time.perf_counter()
                index.search(q[a : a + batch_size], topk, nprobe)
                if i:  # the first batch is a warm-up
                    times.append(time.perf_counter() - t0)
            sec = float(np.median(times))
            seconds.append(sec)
            rows.append(
                {
                    "tier_bytes": int(size),
                    "resident_bytes": 0 if tier is None else tier.num_bytes,
                    "num_clusters": 0 if tier is None else len(tier.clusters),
                    "batch_seconds": sec,
                }  # fmt: skip
            )
            logger.info("T_R: tier %.3f GB -> batch of %d in %.4f s", size / 1e9, batch_size, sec)
    finally:
        index.drop_gpu_tier()
    profile = ThroughputProfile.from_batch_latency(
        sizes, seconds, batch_size, retrievals_per_request
    )
    return profile, rows


def write_profile(
    path: str | Path,
    generation: ThroughputProfile,
    retrieval: ThroughputProfile,
    *,
    gpu_memory_bytes: int | None,
    kv_block_bytes: int,
    meta: dict[str, Any] | None = None,
) -> Path:
    """The profile file (atomic write); ``load_profiles`` reads its two profiles back."""
    from ragserve.retrieval.storage import atomic_write_bytes

    doc = {
        "generation_profile": [list(p) for p in zip(*_points(generation), strict=True)],
        "retrieval_profile": [list(p) for p in zip(*_points(retrieval), strict=True)],
        "gpu_memory_bytes": gpu_memory_bytes,
        "kv_block_bytes": int(kv_block_bytes),
        "meta": meta or {},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, json.dumps(doc, indent=1).encode())
    return out


def _points(profile: ThroughputProfile) -> tuple[list[float], list[float]]:
    return list(profile.sizes), list(profile.requests_per_second)


def _ascending(name: str, values: Sequence[int], *, minimum: int = 1) -> list[int]:
    sizes = sorted({int(v) for v in values})
    if not sizes or sizes[0] < minimum:
        raise ValueError(f"{name} must be non-empty and >= {minimum}, got {list(values)}")
    return sizes
