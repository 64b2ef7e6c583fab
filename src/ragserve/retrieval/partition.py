"""GPU-tier placement policy (VectorLiteRAG §V-B/§V-C): access counts, Algorithm 1
(``partition``), ``fill_budget``, re-partitioning on drift (``DriftDetector``) and the tier's
``TierUpdater``, which re-places lists on its own thread (a search never waits for a swap;
lists in transit are served by the CPU)::

    scan ──observe──> decayed counts ──every `update_every` scans──> updater: drift?
        evict cold lists <── new plan (fill_budget or Algorithm 1) ──┘
        begin_load hot lists (side stream, at most max_swap_bytes a round)

Contracts and where they depart from the paper: docs/tier_policy.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ragserve.retrieval.hit_rate import BetaHitRate, check_tail_mode
from ragserve.retrieval.latency_model import LatencyModel

if TYPE_CHECKING:
    from ragserve.retrieval.gpu_tier import GpuTier

_MAX_BATCH = 1 << 17


def count_accesses(probe_ids: np.ndarray, nlist: int) -> np.ndarray:
    """Accesses per cluster (float64 ``[nlist]``) in a probe matrix ``[n, nprobe]`` (-1 pads)."""
    ids = np.asarray(probe_ids)
    if ids.ndim != 2:
        raise ValueError(f"probe_ids must be [n, nprobe], got shape {ids.shape}")
    if nlist < 1:
        raise ValueError(f"nlist must be >= 1, got {nlist}")
    valid = ids[ids >= 0].astype(np.int64)
    if valid.size and valid.max() >= nlist:
        raise ValueError(f"probe_ids has cluster {valid.max()} >= nlist {nlist}")
    return np.bincount(valid, minlength=nlist).astype(np.float64)


def decay_counts(counts: np.ndarray | None, new_counts: np.ndarray, decay: float) -> np.ndarray:
    """``counts * decay + new_counts`` (``decay`` in ``(0, 1]``; ``counts=None``: afresh)."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    new = np.asarray(new_counts, dtype=np.float64)
    if counts is None:
        return new.copy()
    if np.shape(counts) != new.shape:
        raise ValueError(f"counts shape {np.shape(counts)} != new_counts shape {new.shape}")
    return np.asarray(counts, dtype=np.float64) * decay + new


def hottest_first(access_counts: np.ndarray) -> np.ndarray:
    """Cluster ids by descending access count; ties by ascending id."""
    return np.argsort(-_check_counts(access_counts), kind="stable")


def _check_counts(access_counts: np.ndarray) -> np.ndarray:
    c = np.asarray(access_counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"access_counts must be 1-D and non-empty, got shape {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("access_counts must be finite and >= 0")
    return c


def access_share(counts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``share[k]``: mean hit rate with the first ``k`` clusters of ``order`` cached."""
    total = counts.sum()
    cum = np.concatenate([[0.0], np.cumsum(counts[order])])
    return np.minimum(cum / total, 1.0) if total > 0 else np.zeros_like(cum)


@dataclass(frozen=True)
class PartitionConfig:
    """Algorithm 1's inputs: ``SLO_search``, ``mu_LLM0`` (queries/s with no index on the GPU),
    ``sigma_max^2``, Eq. 4's ``epsilon``, ``MEM_KVcache`` (None: ``mu`` fixed), the tier's
    budget (None: none) and the tail's mode (``BetaHitRate.tail``)."""

    slo_seconds: float
    throughput: float
    max_variance: float
    queuing_factor: float = 1.0
    kv_cache_bytes: int | None = None
    budget_bytes: int | None = None
    tail_mode: str = "batch_mean"
    tail_quantile: float = 0.1

    def __post_init__(self) -> None:
        if not self.slo_seconds > 0:
            raise ValueError(f"slo_seconds must be > 0, got {self.slo_seconds}")
        if not self.throughput > 0:
            raise ValueError(f"throughput must be > 0, got {self.throughput}")
        if not 0.0 <= self.max_variance < 0.25:
            raise ValueError(f"max_variance must be in [0, 0.25), got {self.max_variance}")
        if not self.queuing_factor >= 0:
            raise ValueError(f"queuing_factor must be >= 0, got {self.queuing_factor}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0 or None, got {self.kv_cache_bytes}")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {self.budget_bytes}")
        check_tail_mode(self.tail_mode, self.tail_quantile)

    @property
    def target_seconds(self) -> float:
        """Eq. 4: ``tau_s = SLO_search / (1 + epsilon)``."""
        return self.slo_seconds / (1.0 + self.queuing_factor)


@dataclass(frozen=True)
class PartitionPlan:
    """The tier's clusters (hottest first), their bytes and mean hit rate, and what the model
    predicts (None without one, ``fill_budget``); ``meets_slo`` False: the largest coverage
    within budget, which misses ``tau_s``."""

    cluster_ids: tuple[int, ...]
    nlist: int
    num_bytes: int
    hit_rate: float
    tail_hit_rate: float | None = None
    batch_size: int | None = None
    predicted_seconds: float | None = None
    target_seconds: float | None = None
    meets_slo: bool | None = None

    @property
    def coverage(self) -> float:
        return len(self.cluster_ids) / self.nlist


def fill_budget(
    access_counts: np.ndarray, cluster_bytes: np.ndarray, budget_bytes: int
) -> PartitionPlan:
    """The longest hottest-first prefix whose ``cluster_bytes`` (the tier's chunk prices,
    ``tier_list_bytes``) fit ``budget_bytes``."""
    counts, sizes = _check_counts(access_counts), _check_bytes(cluster_bytes, access_counts)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    order = hottest_first(counts)
    k = _max_clusters(sizes[order], budget_bytes)
    return _plan(counts, sizes, order, k)


def partition(
    model: LatencyModel,
    access_counts: np.ndarray,
    cluster_bytes: np.ndarray,
    config: PartitionConfig,
) -> PartitionPlan:
    """Algorithm 1: the smallest hottest-first coverage ``k`` for which some batch
    ``1 <= B <= ceil(tau_s mu_LLM(k))`` reaches the hit rate Eq. 1 needs within
    ``min(tau_s, B / mu)``, bisected over ``k`` (NOTE: why every ``B``, and not the paper's
    two: docs/tier_policy.md). ``cluster_bytes`` as for ``fill_budget``."""
    counts, sizes = _check_counts(access_counts), _check_bytes(cluster_bytes, access_counts)
    order = hottest_first(counts)
    share = access_share(counts, order)
    cum_bytes = np.concatenate([[0], np.cumsum(sizes[order])])
    budget = config.budget_bytes
    k_max = len(counts) if budget is None else _max_clusters(sizes[order], budget)
    if config.kv_cache_bytes is not None:
        # NOTE: an index tier as large as MEM_KVcache leaves mu_LLM = 0: never a candidate.
        k_max = min(k_max, int(np.searchsorted(cum_bytes, config.kv_cache_bytes)) - 1)

    def feasible(k: int) -> tuple[int, float] | None:
        return _feasible(model, config, float(share[k]), int(cum_bytes[k]))

    k, found = k_max, feasible(k_max)
    if found is not None:  # feasibility is monotone in k: bisect for the first feasible one
        k = bisect.bisect_left(range(k_max), True, key=lambda k: feasible(k) is not None)
        found = feasible(k)
    meets_slo = found is not None
    if found is None:
        mu = max(_throughput(config, int(cum_bytes[k])), 1e-12)
        batch = min(_MAX_BATCH, max(1, math.ceil(config.target_seconds * mu)))
        dist = BetaHitRate.from_mean(float(share[k]), config.max_variance)
        found = batch, dist.tail(batch, config.tail_mode, config.tail_quantile)
    batch, tail = found
    return dataclasses.replace(
        _plan(counts, sizes, order, k),
        tail_hit_rate=tail,
        batch_size=batch,
        predicted_seconds=model.hybrid_seconds(batch, min(max(tail, 0.0), 1.0)),
        target_seconds=config.target_seconds,
        meets_slo=meets_slo,
    )


def _feasible(
    model: LatencyModel, config: PartitionConfig, mean: float, index_bytes: int
) -> tuple[int, float] | None:
    """The largest feasible batch size and its ``eta_tail``, or ``None``."""
    mu = _throughput(config, index_bytes)
    if mu <= 0:
        return None
    tau = config.target_seconds
    b_max = max(1, math.ceil(tau * mu))
    if b_max > _MAX_BATCH:
        raise ValueError(f"slo_seconds * throughput gives batches of {b_max} > {_MAX_BATCH}")
    batches = np.arange(1, b_max + 1, dtype=np.float64)
    need = model.required_hit_rates(batches, np.minimum(tau, batches / mu))
    dist = BetaHitRate.from_mean(mean, config.max_variance)
    tails = dist.tails(batches, config.tail_mode, config.tail_quantile)
    ok = np.flatnonzero(tails >= need - 1e-12)
    if ok.size == 0:
        return None
    return int(batches[ok[-1]]), float(tails[ok[-1]])


def _throughput(config: PartitionConfig, index_bytes: int) -> float:
    """Algorithm 1 line 5: ``mu_LLM = (MEM_KV - MEM_Index) / MEM_KV * mu_LLM0``."""
    if config.kv_cache_bytes is None:
        return config.throughput
    kv = config.kv_cache_bytes
    return (kv - index_bytes) / kv * config.throughput


def _check_bytes(cluster_bytes: np.ndarray, access_counts: np.ndarray) -> np.ndarray:
    sizes = np.asarray(cluster_bytes, dtype=np.int64)
    if sizes.shape != np.shape(access_counts):
        raise ValueError(
            f"cluster_bytes shape {sizes.shape} != access_counts shape {np.shape(access_counts)}"
        )
    if np.any(sizes < 0):
        raise ValueError("cluster_bytes must be >= 0")
    return sizes


def _max_clusters(sizes_in_order: np.ndarray, budget_bytes: int) -> int:
    return int(np.searchsorted(np.cumsum(sizes_in_order), budget_bytes, side="right"))


def _plan(counts: np.ndarray, sizes: np.ndarray, order: np.ndarray, k: int) -> PartitionPlan:
    chosen = order[:k]
    share = access_share(counts, order)[k]
    return PartitionPlan(
        tuple(int(c) for c in chosen), len(counts), int(sizes[chosen].sum()), float(share)
    )


@dataclass(frozen=True)
class DriftConfig:
    """When live counts call for a new plan (docs/tier_policy.md): the plan's live hit rate
    fell ``drop`` below its own, or the same count of hottest clusters beats it by
    ``min_gain``, in ``patience`` checks of at least ``min_accesses`` decayed probes."""

    drop: float = 0.1
    min_gain: float = 0.05
    patience: int = 3
    min_accesses: float = 256.0

    def __post_init__(self) -> None:
        if not 0.0 < self.drop <= 1.0:
            raise ValueError(f"drop must be in (0, 1], got {self.drop}")
        if not 0.0 < self.min_gain <= 1.0:
            raise ValueError(f"min_gain must be in (0, 1], got {self.min_gain}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if self.min_accesses < 0:
            raise ValueError(f"min_accesses must be >= 0, got {self.min_accesses}")


@dataclass(frozen=True)
class DriftDecision:
    """The plan's live hit rate and the best of its size (None: too few accesses)."""

    live_hit_rate: float | None
    best_hit_rate: float | None
    should_repartition: bool


class DriftDetector:
    """``check`` mutates the streak; another plan or a positive decision resets it."""

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        self.streak = 0
        self._plan_clusters: tuple[int, ...] | None = None

    def check(self, plan: PartitionPlan, live_counts: np.ndarray) -> DriftDecision:
        counts = _check_counts(live_counts)
        if len(counts) != plan.nlist:
            raise ValueError(f"live_counts has {len(counts)} clusters, plan has {plan.nlist}")
        if plan.cluster_ids != self._plan_clusters:
            self._plan_clusters, self.streak = plan.cluster_ids, 0
        total = counts.sum()
        if total <= 0 or total < self.config.min_accesses:
            return DriftDecision(None, None, False)
        live = float(counts[list(plan.cluster_ids)].sum() / total)
        best = float(access_share(counts, hottest_first(counts))[len(plan.cluster_ids)])
        fell, gain = plan.hit_rate - live, best - live
        cfg = self.config
        if fell > cfg.drop or gain >= cfg.min_gain:
            self.streak += 1
        elif fell <= cfg.drop / 2 and gain < cfg.min_gain / 2:
            self.streak = 0
        fire = self.streak >= cfg.patience
        if fire:
            self.streak = 0
        return DriftDecision(live, best, fire)


logger = logging.getLogger(__name__)

LoadLists = Callable[[Sequence[int]], int]  # begin_load each list under the index's lock


@dataclass(frozen=True)
class PlacementConfig:
    """Counts decay by ``decay`` a query; the updater checks every ``update_every`` scans and
    moves at most ``max_swap_bytes`` a round. With ``latency_model`` and ``partition`` a plan
    is Algorithm 1's, else the hottest lists that fill the tier (``fill_budget``)."""

    decay: float = 0.999
    update_every: int = 50
    max_swap_bytes: int = 1 << 30
    drift: DriftConfig = DriftConfig()
    latency_model: LatencyModel | None = None
    partition: PartitionConfig | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {self.update_every}")
        if self.max_swap_bytes < 1:
            raise ValueError(f"max_swap_bytes must be >= 1, got {self.max_swap_bytes}")


class AccessCounts:
    """Decayed per-cluster probe counts of the live query stream (thread-safe)."""

    def __init__(self, nlist: int, decay: float = 0.999) -> None:
        self.nlist, self.decay = nlist, decay
        self._counts = np.zeros(nlist, np.float64)
        self._lock = threading.Lock()
        self.num_queries = 0

    def observe(self, probe_ids: np.ndarray) -> None:
        new = count_accesses(np.asarray(probe_ids), self.nlist)
        with self._lock:
            self._counts = decay_counts(self._counts, new, self.decay ** len(probe_ids))
            self.num_queries += len(probe_ids)

    def snapshot(self) -> np.ndarray:
        with self._lock:
            return self._counts.copy()


def plan_placement(
    counts: np.ndarray, tier: GpuTier, sizes: np.ndarray, config: PlacementConfig | None = None
) -> PartitionPlan:
    """The plan ``config`` asks for, within the tier's chunks."""
    chunk_bytes = tier.list_bytes(sizes)
    capacity = tier.capacity_chunks * tier.chunk_bytes
    if config is None or config.latency_model is None or config.partition is None:
        return fill_budget(counts, chunk_bytes, capacity)
    budget = config.partition.budget_bytes
    bounded = dataclasses.replace(
        config.partition, budget_bytes=capacity if budget is None else min(budget, capacity)
    )
    return partition(config.latency_model, counts, chunk_bytes, bounded)


class TierUpdater:
    """Background re-placement of one tier; ``close()`` stops it."""

    def __init__(
        self,
        tier: GpuTier,
        counts: AccessCounts,
        plan: PartitionPlan,
        load_lists: LoadLists,
        cluster_sizes: Callable[[], np.ndarray],
        config: PlacementConfig,
    ) -> None:
        self.tier, self.counts, self.plan = tier, counts, plan
        self.config = config
        self._load_lists, self._sizes = load_lists, cluster_sizes
        self._detector = DriftDetector(config.drift)
        self._wake = threading.Event()
        self._stop = False
        self._scans = 0
        self.num_replans = 0
        self.num_rounds = 0
        self._thread = threading.Thread(target=self._run, name="gpu-tier-updater", daemon=True)
        self._thread.start()

    def note_scan(self) -> None:
        self._scans += 1
        if self._scans % self.config.update_every == 0:
            self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                self.update_now()
            except Exception:
                logger.exception("GPU tier update failed; the CPU serves what is not resident")

    def update_now(self, *, force: bool = False) -> None:
        self.tier.poll()
        live = self.counts.snapshot()
        decision = self._detector.check(self.plan, live)
        if force or decision.should_repartition:
            self.plan = plan_placement(live, self.tier, self._sizes(), self.config)
            self._detector = DriftDetector(self.config.drift)
            self.num_replans += 1
        self._apply(self.plan)
        self.num_rounds += 1

    def _apply(self, plan: PartitionPlan) -> None:
        """Evict what ``plan`` drops, then load its missing lists in order, as many as fit in
        ``max_swap_bytes``."""
        tier, wanted = self.tier, set(plan.cluster_ids)
        tier.evict([c for c in tier.clusters + tier.loading if c not in wanted])
        tier.poll()
        have = set(tier.clusters + tier.loading)
        missing = [c for c in plan.cluster_ids if c not in have]
        sizes = self._sizes()
        cost = np.cumsum([tier.chunks_for(int(sizes[c])) * tier.chunk_bytes for c in missing])
        batch = missing[: int(np.searchsorted(cost, self.config.max_swap_bytes, side="right"))]
        if batch:
            self._load_lists(batch)
