"""The GPU memory split between the KV cache and the index tier, HedraRAG Eq. 2::

    KV_size* = argmax_{KV_size} min{ T_G(KV_size, rps_G), T_R(total - KV_size, rps_R) }

over whole KV blocks (``solve_memory_split``), from throughput profiles (requests/s) of
generation by KV size and of retrieval by tier bytes (NOTE: the paper's ``T_R`` ignores a GPU
tier; here it depends on the tier's bytes: measured by ``ragserve profile-memory``, or
modelled in ``bench/eq2_model.py``); and ``plan_gpu_memory``, which applies it at start::

    gpu_memory_bytes (free on the device - model weights, or given)
      ├── KV cache: num_kv_blocks * block_bytes  -> engine_kwargs["kv_cache_bytes"]
      └── index tier                             -> the tier's budget_bytes

An explicit ``budget_bytes`` or ``kv_cache_bytes`` overrides its side; otherwise the split
needs both profiles (``ValueError`` naming the field).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragserve.runtime.config import ServerConfig, at_least

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThroughputProfile:
    """Throughput (requests/s) at ascending sizes (KV blocks or bytes), interpolated linearly
    and held flat past the ends."""

    sizes: tuple[float, ...]
    requests_per_second: tuple[float, ...]

    def __post_init__(self) -> None:
        s = np.asarray(self.sizes, dtype=np.float64)
        r = np.asarray(self.requests_per_second, dtype=np.float64)
        if s.ndim != 1 or s.size == 0 or s.shape != r.shape:
            raise ValueError(
                f"sizes and requests_per_second must be non-empty and of equal length, "
                f"got {len(self.sizes)} and {len(self.requests_per_second)}"
            )
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(r))):
            raise ValueError("sizes and requests_per_second must be finite")
        if np.any(np.diff(s) <= 0) or s[0] < 0:
            raise ValueError(f"sizes must be >= 0 and strictly ascending, got {self.sizes}")
        if np.any(r < 0):
            raise ValueError("requests_per_second must be >= 0")

    def at(self, sizes: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(sizes, dtype=np.float64), self.sizes, self.requests_per_second)

    @classmethod
    def from_batch_latency(
        cls,
        sizes: Sequence[float],
        batch_seconds: Sequence[float],
        batch_size: int,
        retrievals_per_request: float = 1.0,
    ) -> ThroughputProfile:
        """``batch_size / (seconds * retrievals_per_request)`` requests/s at each size."""
        if batch_size < 1 or retrievals_per_request <= 0:
            raise ValueError(
                f"need batch_size >= 1 and retrievals_per_request > 0, "
                f"got {batch_size} and {retrievals_per_request}"
            )
        secs = np.asarray(batch_seconds, dtype=np.float64)
        if np.any(secs <= 0):
            raise ValueError("batch_seconds must be > 0")
        rps = batch_size / (secs * retrievals_per_request)
        return cls(tuple(float(s) for s in sizes), tuple(float(r) for r in rps))


@dataclass(frozen=True)
class MemorySplit:
    """GPU bytes for the KV cache (``num_kv_blocks`` whole blocks) and the index tier;
    ``source``: ``"eq2"`` or ``"override"``; the profiles' throughputs at the split."""

    kv_cache_bytes: int
    index_tier_bytes: int
    num_kv_blocks: int
    source: str
    generation_rps: float | None = None
    retrieval_rps: float | None = None

    @property
    def predicted_rps(self) -> float | None:
        if self.generation_rps is None or self.retrieval_rps is None:
            return None
        return min(self.generation_rps, self.retrieval_rps)


def solve_memory_split(
    total_bytes: int,
    block_bytes: int,
    generation: ThroughputProfile | None,
    retrieval: ThroughputProfile | None,
    *,
    min_kv_blocks: int = 1,
    max_index_bytes: int | None = None,
    kv_cache_bytes: int | None = None,
    index_tier_bytes: int | None = None,
) -> MemorySplit:
    """Eq. 2 over ``n >= min_kv_blocks`` KV blocks; ``generation`` is ``T_G`` by KV blocks,
    ``retrieval`` ``T_R`` by tier bytes, capped at ``max_index_bytes``. Ties go to the larger
    ``T_G + T_R``, then to more KV blocks. An override (``kv_cache_bytes`` and/or
    ``index_tier_bytes``) skips the solver; the profiles may then be ``None``."""
    at_least(1, block_bytes=block_bytes)
    at_least(0, min_kv_blocks=min_kv_blocks, max_index_bytes=max_index_bytes)
    at_least(0, kv_cache_bytes=kv_cache_bytes, index_tier_bytes=index_tier_bytes)
    if total_bytes < min_kv_blocks * block_bytes:
        raise ValueError(
            f"total_bytes {total_bytes} < min_kv_blocks * block_bytes "
            f"({min_kv_blocks} * {block_bytes})"
        )
    source = "eq2" if kv_cache_bytes is None and index_tier_bytes is None else "override"
    if source == "eq2":
        if generation is None or retrieval is None:
            raise ValueError("generation and retrieval profiles are required without an override")
        blocks = np.arange(min_kv_blocks, total_bytes // block_bytes + 1, dtype=np.int64)
        tiers = total_bytes - blocks * block_bytes
        if max_index_bytes is not None:
            tiers = np.minimum(tiers, max_index_bytes)
        t_g, t_r = generation.at(blocks), retrieval.at(tiers)
        ties = np.flatnonzero(_at_max(np.minimum(t_g, t_r)))
        i = int(ties[_at_max(t_g[ties] + t_r[ties])][-1])
        n, tier = int(blocks[i]), int(tiers[i])
    else:
        if kv_cache_bytes is None:
            if index_tier_bytes > total_bytes:
                raise ValueError(f"index_tier_bytes {index_tier_bytes} > total_bytes {total_bytes}")
            kv_cache_bytes = total_bytes - index_tier_bytes
        n = kv_cache_bytes // block_bytes
        if n < min_kv_blocks:
            raise ValueError(
                f"kv_cache_bytes {kv_cache_bytes} holds {n} blocks < min_kv_blocks {min_kv_blocks}"
            )
        tier = index_tier_bytes
        if tier is None:
            tier = total_bytes - n * block_bytes
            tier = tier if max_index_bytes is None else min(tier, max_index_bytes)
        if n * block_bytes + tier > total_bytes:
            raise ValueError(
                f"kv_cache_bytes {n * block_bytes} + index_tier_bytes {tier} > total_bytes "
                f"{total_bytes}"
            )
    t_g = None if generation is None else float(generation.at(np.asarray([n]))[0])
    t_r = None if retrieval is None else float(retrieval.at(np.asarray([tier]))[0])
    return MemorySplit(n * block_bytes, int(tier), n, source, t_g, t_r)


def _at_max(values: np.ndarray) -> np.ndarray:
    # NOTE: relative tie tolerance so that plateaus of measured curves count as ties.
    return values >= values.max() - 1e-9 * max(abs(values.max()), 1.0)


@dataclass(frozen=True)
class TierPlan:
    """What start-up resolved: the tier's bytes (``None``: no tier) and how (``source``)."""

    tier_bytes: int | None
    kv_cache_bytes: int | None
    source: str  # "off" | "override" | "eq2"


def plan_gpu_memory(config: ServerConfig, model: Any, index: Any) -> tuple[ServerConfig, TierPlan]:
    """``config`` with the engine's ``kv_cache_bytes`` set from the split, and the plan."""
    tier = config.gpu_tier
    if tier is None:
        return config, TierPlan(None, None, "off")
    engine = dict(config.engine_kwargs)
    kv = engine.get("kv_cache_bytes")
    if tier.budget_bytes is not None and (kv is not None or tier.device == "cpu"):
        if kv is not None:
            _check_fits(tier, kv, model, engine)
        return config, TierPlan(tier.budget_bytes, kv, "override")
    block_bytes = kv_block_bytes(model, engine)
    total = _gpu_bytes(tier, model, engine)
    gen = _profile(tier.generation_profile, "generation_profile")
    ret = _profile(tier.retrieval_profile, "retrieval_profile")
    if tier.budget_bytes is None and kv is None and (gen is None or ret is None):
        raise ValueError(
            "gpu_tier.budget_bytes: give a tier size, or generation_profile and "
            "retrieval_profile for Eq. 2"
        )
    split = solve_memory_split(
        total,
        block_bytes,
        gen,
        ret,
        max_index_bytes=_index_bytes(index),
        kv_cache_bytes=kv,
        index_tier_bytes=tier.budget_bytes,
    )
    engine["kv_cache_bytes"] = split.kv_cache_bytes
    logger.info(
        "GPU memory split (%s): KV %.2f GB (%d blocks), index tier %.2f GB",
        split.source,
        split.kv_cache_bytes / 1e9,
        split.num_kv_blocks,
        split.index_tier_bytes / 1e9,
    )
    resolved = dataclasses.replace(config, engine_kwargs=tuple(sorted(engine.items())))
    return resolved, TierPlan(split.index_tier_bytes, split.kv_cache_bytes, split.source)


def _check_fits(tier: Any, kv: int, model: Any, engine: dict[str, Any]) -> None:
    """Both sides given: they must fit beside the weights on one GPU, a ``ValueError`` at start
    rather than an out-of-memory step under load (an 80 GB card given an H200's sizes)."""
    same_gpu = str(engine.get("device", "auto")) in ("auto", "cuda", "cuda:0", tier.device)
    if not (tier.gpu_memory_bytes or (same_gpu and tier.device.startswith("cuda"))):
        return
    try:
        total = _gpu_bytes(tier, model, engine)
    except ValueError:
        return  # nothing to measure against (no CUDA here): the sizes given stand
    if kv + tier.budget_bytes > total:
        raise ValueError(
            f"gpu_tier.budget_bytes ({tier.budget_bytes / 1e9:.2f} GB) + kv_cache_bytes "
            f"({kv / 1e9:.2f} GB) exceed the {total / 1e9:.2f} GB of {tier.device} left beside "
            "the model's weights; lower one of them"
        )


def load_profiles(path: str | Path) -> dict[str, tuple[tuple[float, float], ...]]:
    """The two profiles of a ``write_profile`` file, as ``GpuTierConfig`` fields."""
    data = json.loads(Path(path).read_text())
    out = {}
    for key in ("generation_profile", "retrieval_profile"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
        out[key] = tuple((float(a), float(b)) for a, b in data[key])
    return out


def _profile(points: Any, name: str) -> ThroughputProfile | None:
    if points is None:
        return None
    if not points:
        raise ValueError(f"gpu_tier.{name} must have at least one (size, rps) point")
    sizes, rps = zip(*points, strict=True)
    return ThroughputProfile(tuple(float(s) for s in sizes), tuple(float(r) for r in rps))


def kv_block_bytes(model: Any, engine_kwargs: dict[str, Any]) -> int:
    """Bytes of one KV block of ``model`` (an engine, a folder or a built-in name)."""
    from ragserve.generation.config import ModelConfig
    from ragserve.generation.model_runner import kv_cache_bytes_per_block

    cfg = getattr(model, "model_config", None)
    cfg = cfg or ModelConfig.from_folder(model_folder(model, engine_kwargs))
    block = int(engine_kwargs.get("block_size", 16))
    dtype = kv_dtype(engine_kwargs.get("dtype", "auto"), engine_kwargs.get("device", "auto"))
    return int(kv_cache_bytes_per_block(cfg, block, dtype))


def free_gpu_bytes(device: str) -> int:
    """92 % of the free memory on CUDA ``device`` (``ValueError`` naming
    ``gpu_tier.gpu_memory_bytes`` when it cannot be measured)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(
            f"gpu_tier.gpu_memory_bytes: cannot measure GPU memory on {device!r}; give it"
        )
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free * 0.92)  # NOTE: headroom for activations, CUDA graphs and the allocator


def _gpu_bytes(tier: Any, model: Any, engine: dict[str, Any]) -> int:
    """The tier's ``gpu_memory_bytes``, else ``free_gpu_bytes`` minus the model's weights."""
    if tier.gpu_memory_bytes:
        return tier.gpu_memory_bytes
    weights = sum(f.stat().st_size for f in model_folder(model, engine).glob("*.safetensors"))
    return free_gpu_bytes(tier.device) - weights


def model_folder(model: Any, engine_kwargs: dict[str, Any]) -> Path:
    """A random-weight (``load_format="dummy"``) folder as is, else ``resolve_model``'s."""
    if not isinstance(model, (str, Path)):
        raise ValueError("gpu_tier: the model must be a folder or a built-in name to plan memory")
    folder = Path(str(model))
    if engine_kwargs.get("load_format") == "dummy" and (folder / "config.json").is_file():
        return folder
    from ragserve.generation.builtin import resolve_model

    return resolve_model(model)


def _index_bytes(index: Any) -> int | None:
    from ragserve.retrieval import VectorIndex

    if isinstance(index, VectorIndex):
        return int(index.cluster_cost_bytes().sum())
    folder = Path(str(index))
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    generation = int(json.loads(manifest.read_text()).get("generation", 1))
    from ragserve.retrieval.storage import snapshot_name

    snapshot = folder / snapshot_name(generation)
    return snapshot.stat().st_size if snapshot.is_file() else None


def kv_dtype(name: str, device: str = "auto") -> Any:
    """The KV cache's torch dtype (``auto``: bfloat16 on CUDA, float32 on CPU)."""
    import torch

    if name == "auto":
        on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        return torch.bfloat16 if on_cuda else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class GenerationWorkload:
    prompt_tokens: int = 64
    output_tokens: int = 128
    num_requests: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(1, **{k: v for k, v in dataclasses.asdict(self).items() if k != "seed"})

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def measure_generation_profile(
    model: str | Path,
    engine_kwargs: dict[str, Any],
    kv_blocks: Sequence[int],
    workload: GenerationWorkload | None = None,
) -> tuple[ThroughputProfile, list[dict]]:
    """``T_G``: completed requests/s at each KV size (one engine each, the workload queued at
    once), and a row per size; ``ValueError`` when a size cannot hold one request."""
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
    rows = []
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
    rps = tuple(row["rps"] for row in rows)
    return ThroughputProfile(tuple(float(s) for s in sizes), rps), rows


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
    """``T_R``: requests/s at each tier size (hottest lists by ``queries``' probes) serving
    back-to-back batches, and a row per size; the tier is dropped at the end."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if batch_size < 1 or len(q) < batch_size:
        raise ValueError(f"batch_size must be in [1, {len(q)}] (the queries), got {batch_size}")
    at_least(1, min_batches=min_batches)
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
    from ragserve.retrieval.storage import atomic_write_bytes

    doc = {
        "generation_profile": [list(p) for p in zip(*astuple(generation), strict=True)],
        "retrieval_profile": [list(p) for p in zip(*astuple(retrieval), strict=True)],
        "gpu_memory_bytes": gpu_memory_bytes,
        "kv_block_bytes": int(kv_block_bytes),
        "meta": meta or {},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, json.dumps(doc, indent=1).encode())
    return out


def _ascending(name: str, values: Sequence[int], *, minimum: int = 1) -> list[int]:
    sizes = sorted({int(v) for v in values})
    if not sizes or sizes[0] < minimum:
        raise ValueError(f"{name} must be non-empty and >= {minimum}, got {list(values)}")
    return sizes
