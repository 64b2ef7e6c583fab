"""HedraRAG Eq. 2: split GPU memory between KV-cache blocks and the index tier::

    KV_size* = argmax_{KV_size} min{ T_G(KV_size, rps_G), T_R(total - KV_size, rps_R) }

over whole KV blocks, from throughput profiles (requests/s) of generation by KV size and of
retrieval by tier bytes (NOTE: the paper's ``T_R`` ignores a GPU tier; here it depends on the
tier's bytes: measured, or modelled in ``bench/eq2_model.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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
    _check_sizes(total_bytes, block_bytes, min_kv_blocks, max_index_bytes)
    if kv_cache_bytes is not None or index_tier_bytes is not None:
        requested = (kv_cache_bytes, index_tier_bytes, max_index_bytes)
        return _override(total_bytes, block_bytes, min_kv_blocks, requested, generation, retrieval)
    if generation is None or retrieval is None:
        raise ValueError("generation and retrieval profiles are required without an override")
    blocks = np.arange(min_kv_blocks, total_bytes // block_bytes + 1, dtype=np.int64)
    tier = total_bytes - blocks * block_bytes
    if max_index_bytes is not None:
        tier = np.minimum(tier, max_index_bytes)
    t_g, t_r = generation.at(blocks), retrieval.at(tier)
    ties = np.flatnonzero(_at_max(np.minimum(t_g, t_r)))
    i = int(ties[_at_max(t_g[ties] + t_r[ties])][-1])
    n = int(blocks[i])
    return MemorySplit(n * block_bytes, int(tier[i]), n, "eq2", float(t_g[i]), float(t_r[i]))


def _at_max(values: np.ndarray) -> np.ndarray:
    # NOTE: relative tie tolerance so that plateaus of measured curves count as ties.
    return values >= values.max() - 1e-9 * max(abs(values.max()), 1.0)


def _check_sizes(
    total_bytes: int, block_bytes: int, min_kv_blocks: int, max_index_bytes: int | None
) -> None:
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    if min_kv_blocks < 0:
        raise ValueError(f"min_kv_blocks must be >= 0, got {min_kv_blocks}")
    if total_bytes < min_kv_blocks * block_bytes:
        raise ValueError(
            f"total_bytes {total_bytes} < min_kv_blocks * block_bytes "
            f"({min_kv_blocks} * {block_bytes})"
        )
    if max_index_bytes is not None and max_index_bytes < 0:
        raise ValueError(f"max_index_bytes must be >= 0 or None, got {max_index_bytes}")


def _override(
    total_bytes: int,
    block_bytes: int,
    min_kv_blocks: int,
    requested: tuple[int | None, int | None, int | None],
    generation: ThroughputProfile | None,
    retrieval: ThroughputProfile | None,
) -> MemorySplit:
    kv_cache_bytes, index_tier_bytes, max_index_bytes = requested
    for name, value in (("kv_cache_bytes", kv_cache_bytes), ("index_tier_bytes", index_tier_bytes)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if kv_cache_bytes is None:
        assert index_tier_bytes is not None
        if index_tier_bytes > total_bytes:
            raise ValueError(f"index_tier_bytes {index_tier_bytes} > total_bytes {total_bytes}")
        kv_cache_bytes = total_bytes - index_tier_bytes
    n = kv_cache_bytes // block_bytes
    if n < min_kv_blocks:
        raise ValueError(
            f"kv_cache_bytes {kv_cache_bytes} holds {n} blocks < min_kv_blocks {min_kv_blocks}"
        )
    kv = n * block_bytes
    tier = total_bytes - kv if index_tier_bytes is None else index_tier_bytes
    if index_tier_bytes is None and max_index_bytes is not None:
        tier = min(tier, max_index_bytes)
    if kv + tier > total_bytes:
        raise ValueError(
            f"kv_cache_bytes {kv} + index_tier_bytes {tier} > total_bytes {total_bytes}"
        )
    t_g = None if generation is None else float(generation.at(np.asarray([n]))[0])
    t_r = None if retrieval is None else float(retrieval.at(np.asarray([tier]))[0])
    return MemorySplit(kv, int(tier), int(n), "override", t_g, t_r)
