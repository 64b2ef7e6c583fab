"""GPU-tier placement policy: VectorLiteRAG §V-B/§V-C (access counts, Algorithm 1:
``partition``, ``fill_budget``) and online re-partitioning (``DriftDetector``, stateful). The
batch's tail hit rate is ``hit_rate.BetaHitRate.tail`` in one of ``TAIL_MODES``:
``"batch_mean"`` (the default: the CPU scans a batch's missed lists as one pool, so Eq. 1
needs the pooled rate's 10th percentile) or ``"min"`` (the paper's Eq. 2); why the default,
and every contract: docs/tier_policy.md. Pure NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.hit_rate import BetaHitRate, check_tail_mode
from ragserve.retrieval.latency_model import LatencyModel

_MAX_BATCH = 1 << 17


# -- access counts ------------------------------------------------------------------------------


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
    """Exponentially decayed access counts: ``counts * decay + new_counts``.

    ``decay`` in ``(0, 1]`` per window (1 keeps everything); ``counts=None`` starts afresh.
    """
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    new = np.asarray(new_counts, dtype=np.float64)
    if counts is None:
        return new.copy()
    if np.shape(counts) != new.shape:
        raise ValueError(f"counts shape {np.shape(counts)} != new_counts shape {new.shape}")
    return np.asarray(counts, dtype=np.float64) * decay + new


def hottest_first(access_counts: np.ndarray) -> np.ndarray:
    """Cluster ids by descending access count; ties by ascending id (a stable order)."""
    return np.argsort(-_check_counts(access_counts), kind="stable")


def per_query_hit_rates(probe_ids: np.ndarray, on_gpu: np.ndarray) -> np.ndarray:
    """Each query's fraction of valid probes whose cluster is on the GPU (``on_gpu[c]``).

    Queries without a valid probe are dropped.
    """
    ids = np.asarray(probe_ids)
    mask = np.asarray(on_gpu, dtype=bool)
    if ids.ndim != 2:
        raise ValueError(f"probe_ids must be [n, nprobe], got shape {ids.shape}")
    valid = ids >= 0
    hits = (mask[np.where(valid, ids, 0)] & valid).sum(axis=1)
    num = valid.sum(axis=1)
    keep = num > 0
    return hits[keep] / num[keep]


def _check_counts(access_counts: np.ndarray) -> np.ndarray:
    c = np.asarray(access_counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"access_counts must be 1-D and non-empty, got shape {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("access_counts must be finite and >= 0")
    return c


def _access_share(counts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``share[k]``: mean hit rate with the first ``k`` clusters of ``order`` cached."""
    total = counts.sum()
    cum = np.concatenate([[0.0], np.cumsum(counts[order])])
    return np.minimum(cum / total, 1.0) if total > 0 else np.zeros_like(cum)


def profile_max_variance(probe_ids: np.ndarray, nlist: int) -> float:
    """``sigma_max^2`` from calibration probes: per-query hit-rate variances at the hottest-
    first coverages whose mean hit rate is near 0.1, 0.2, ..., 0.9, least-squares fitted to
    ``var = 4 sigma_max^2 mean (1 - mean)``."""
    counts = count_accesses(probe_ids, nlist)
    if counts.sum() == 0:
        raise ValueError("probe_ids has no valid probe")
    order = hottest_first(counts)
    share = _access_share(counts, order)
    ks = np.unique(np.searchsorted(share, np.linspace(0.1, 0.9, 9)).clip(1, nlist))
    num = den = 0.0
    for k in ks:
        on_gpu = np.zeros(nlist, dtype=bool)
        on_gpu[order[:k]] = True
        rates = per_query_hit_rates(probe_ids, on_gpu)
        g = 4.0 * rates.mean() * (1.0 - rates.mean())
        num += g * rates.var()
        den += g * g
    if den == 0.0:
        return 0.0
    return float(min(num / den, 0.25 * (1.0 - 1e-6)))


def hit_rate_to_coverage(
    access_counts: np.ndarray,
    max_variance: float,
    tail_hit_rate: float,
    batch_size: int,
    *,
    tail_mode: str = "batch_mean",
    tail_quantile: float = 0.1,
) -> int | None:
    """``Hitrate2Coverage``: the fewest hottest clusters whose tail hit rate over
    ``batch_size`` queries (``BetaHitRate.tail``) reaches ``tail_hit_rate``; ``None`` if not
    even all clusters do."""
    counts = _check_counts(access_counts)
    share = _access_share(counts, hottest_first(counts))
    check_tail_mode(tail_mode, tail_quantile)

    def tail(mean: float) -> float:
        dist = BetaHitRate.from_mean(float(mean), max_variance)
        return dist.tail(batch_size, tail_mode, tail_quantile)

    lo, hi = 0, len(counts)
    if tail(share[hi]) < tail_hit_rate:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if tail(share[mid]) >= tail_hit_rate:
            hi = mid
        else:
            lo = mid + 1
    return lo


# -- Algorithm 1 --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionConfig:
    """Inputs of Algorithm 1 (seconds, bytes, queries/s).

    - ``slo_seconds``: ``SLO_search``, the retrieval stage's share of the request SLO;
    - ``throughput``: ``mu_LLM0``, queries/s the retriever must sustain with no index on the GPU;
    - ``max_variance``: ``sigma_max^2`` (``profile_max_variance``);
    - ``queuing_factor``: ``epsilon`` of Eq. 4 (1: one batch of queueing, the paper's choice);
    - ``kv_cache_bytes``: ``MEM_KVcache``, KV bytes with no index; ``None`` keeps ``mu`` fixed;
    - ``budget_bytes``: most bytes the tier may hold; ``None``: no limit;
    - ``tail_mode`` / ``tail_quantile``: how a batch's tail hit rate is taken
      (``BetaHitRate.tail``; ``"min"`` is the paper's Eq. 2).
    """

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
    """Which clusters go to the GPU tier, and what the model predicts for them.

    ``cluster_ids`` hottest first; ``num_bytes`` their total size; ``hit_rate`` the expected
    mean per-query hit rate (their share of accesses). The latency fields are ``None`` for a
    plan made without a latency model (``fill_budget``): ``batch_size`` ``B``,
    ``tail_hit_rate`` ``eta_tail(B)``, ``predicted_seconds`` Eq. 1 at both,
    ``target_seconds`` ``tau_s``; ``meets_slo`` is False when the budget (or the model) allows
    no coverage that meets ``tau_s`` (then the plan is the largest coverage within budget).
    """

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
        """``rho``: the fraction of clusters on the GPU."""
        return len(self.cluster_ids) / self.nlist


def fill_budget(
    access_counts: np.ndarray, cluster_bytes: np.ndarray, budget_bytes: int
) -> PartitionPlan:
    """The longest hottest-first prefix of clusters whose bytes fit ``budget_bytes``.
    ``cluster_bytes`` for a GPU tier: its chunk prices (``gpu_tier.tier_list_bytes``), never
    raw list bytes (a pick would not load)."""
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
    """Algorithm 1: the smallest hottest-first coverage meeting ``tau_s`` (see module doc).
    ``cluster_bytes`` as for ``fill_budget``: the tier's chunk prices.

    Coverage ``k`` is feasible when, at ``mu = mu_LLM(k)``, some batch size
    ``1 <= B <= ceil(tau_s mu)`` has ``eta_tail(B) >= `` the hit rate Eq. 1 needs to finish
    within ``min(tau_s, B / mu)``. NOTE: InferPartition in the paper tries only
    ``B = ceil(tau_s mu)`` (bound ``tau_s``) and ``floor(tau_s mu)`` (bound ``B / mu``); every
    smaller batch also keeps up, so trying them all contains both and makes the coverage
    monotone in the SLO. Feasibility is monotone in ``k`` (more coverage raises ``eta_tail``;
    a lower ``mu`` only shrinks batches) up to the budget and ``MEM_Index < MEM_KVcache``, so
    bisection over ``k`` replaces the paper's bisection over ``rho`` (whose
    ``rho_low <- rho`` step can overshoot the fixed point).
    """
    counts, sizes = _check_counts(access_counts), _check_bytes(cluster_bytes, access_counts)
    order = hottest_first(counts)
    share = _access_share(counts, order)
    cum_bytes = np.concatenate([[0], np.cumsum(sizes[order])])
    budget = config.budget_bytes
    k_max = len(counts) if budget is None else _max_clusters(sizes[order], budget)
    if config.kv_cache_bytes is not None:
        # NOTE: an index tier as large as MEM_KVcache leaves mu_LLM = 0: never a candidate.
        k_max = min(k_max, int(np.searchsorted(cum_bytes, config.kv_cache_bytes)) - 1)

    def check(k: int) -> tuple[int, float] | None:
        return _feasible(model, config, float(share[k]), int(cum_bytes[k]))

    lo, hi = 0, k_max
    if check(hi) is None:
        plan = _plan(counts, sizes, order, k_max)
        return _with_latency(plan, model, config, share[k_max], False)
    while lo < hi:
        mid = (lo + hi) // 2
        if check(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return _with_latency(_plan(counts, sizes, order, lo), model, config, share[lo], True)


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


def _with_latency(
    plan: PartitionPlan,
    model: LatencyModel,
    config: PartitionConfig,
    mean: float,
    meets_slo: bool,
) -> PartitionPlan:
    found = _feasible(model, config, float(mean), plan.num_bytes) if meets_slo else None
    if found is None:
        mu = max(_throughput(config, plan.num_bytes), 1e-12)
        batch = min(_MAX_BATCH, max(1, math.ceil(config.target_seconds * mu)))
        dist = BetaHitRate.from_mean(float(mean), config.max_variance)
        tail = dist.tail(batch, config.tail_mode, config.tail_quantile)
    else:
        batch, tail = found
    return PartitionPlan(
        plan.cluster_ids,
        plan.nlist,
        plan.num_bytes,
        plan.hit_rate,
        tail_hit_rate=tail,
        batch_size=batch,
        predicted_seconds=model.hybrid_seconds(batch, min(max(tail, 0.0), 1.0)),
        target_seconds=config.target_seconds,
        meets_slo=meets_slo,
    )


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
    share = _access_share(counts, order)[k]
    return PartitionPlan(
        tuple(int(c) for c in chosen), len(counts), int(sizes[chosen].sum()), float(share)
    )


# -- drift ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriftConfig:
    """When live access counts call for a new plan.

    A check is *drifting* when the plan's live hit rate (its clusters' share of the live
    counts) is below ``plan.hit_rate - drop`` (the model's premise broke: Algorithm 1 may now
    want more coverage), or when the hottest ``len(plan.cluster_ids)`` clusters by live counts
    beat it by ``min_gain`` (a better placement of the same size exists). ``patience``
    consecutive drifting checks trigger; the streak clears only once both gaps are back under
    half their thresholds (hysteresis). Checks over fewer than ``min_accesses`` decayed
    (query, probe) accesses are ignored.
    """

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
    """One check: the plan's live hit rate and the best at the same cluster count (both
    ``None`` when too few accesses were seen), and whether to re-partition now."""

    live_hit_rate: float | None
    best_hit_rate: float | None
    should_repartition: bool


class DriftDetector:
    """Compares live (decayed) access counts with the current plan; see ``DriftConfig``.

    ``check`` mutates the streak; a plan with different clusters than the last one checked
    starts a new streak, and a positive decision resets it.
    """

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
        best = float(_access_share(counts, hottest_first(counts))[len(plan.cluster_ids)])
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
