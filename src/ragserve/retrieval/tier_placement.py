"""Placement of an index's GPU tier: live access counts, the initial plan, and asynchronous
re-placement on drift (HedraRAG §4.4's periodic updates, VectorLiteRAG's re-partitioning).

```
scan ──observe(probes)──> decayed access counts ──every `update_every` scans──> updater thread
                                                                         │ drift? (DriftDetector)
                                       evict cold lists  <── new plan ───┘ fill_budget(counts)
                                       begin_load hot lists (side stream, bounded bytes a round)
```

The updater runs on its own thread: a search never waits for a swap (lists in transit are
served by the CPU). It starts loads through the index's `load_lists` (under the index's shared
lock, so upserts wait, searches do not).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.gpu_tier import GpuTier
from ragserve.retrieval.latency_model import LatencyModel
from ragserve.retrieval.partition import (
    DriftConfig,
    DriftDetector,
    PartitionConfig,
    PartitionPlan,
    count_accesses,
    decay_counts,
    fill_budget,
    partition,
)

logger = logging.getLogger(__name__)

LoadLists = Callable[[Sequence[int]], int]  # begin_load each list under the index's lock


@dataclass(frozen=True)
class PlacementConfig:
    """``decay`` per query of the access counts; the updater checks every ``update_every``
    scans (HedraRAG: 50 sub-stages) and moves at most ``max_swap_bytes`` a round.

    With ``latency_model`` and ``partition`` (VectorLiteRAG), a plan is Algorithm 1's smallest
    coverage meeting the search SLO within the tier (``retrieval.partition.partition``);
    without them, the hottest lists that fill the tier (``fill_budget``).
    """

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
    counts: np.ndarray,
    tier: GpuTier,
    sizes: np.ndarray,
    config: PlacementConfig | None = None,
) -> PartitionPlan:
    """Hottest lists first within the tier's chunks: Algorithm 1 when ``config`` has a latency
    model and partition inputs, else as many as fit (``fill_budget``)."""
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
    """Background re-placement of one tier (see module doc); ``close()`` stops it."""

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
        """Called after each scan; wakes the updater every ``update_every`` scans."""
        self._scans += 1
        if self._scans % self.config.update_every == 0:
            self._wake.set()

    def update_now(self, *, force: bool = False) -> None:
        """One round on the caller's thread (tests, benchmarks)."""
        self._round(force=force)

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
                self._round(force=False)
            except Exception:
                logger.exception("GPU tier update failed; the CPU serves what is not resident")

    def _round(self, *, force: bool) -> None:
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
        """Evict what the plan drops (and lists invalidated by writes), load what it adds."""
        want = list(plan.cluster_ids)
        wanted = set(want)
        self.tier.evict([c for c in self.tier.clusters + self.tier.loading if c not in wanted])
        self.tier.poll()
        have = set(self.tier.clusters) | set(self.tier.loading)
        missing = [c for c in want if c not in have]
        budget = self.config.max_swap_bytes
        batch: list[int] = []
        sizes = self._sizes()
        for c in missing:
            cost = self.tier.chunks_for(int(sizes[c])) * self.tier.chunk_bytes
            if cost > budget:
                break
            budget -= cost
            batch.append(c)
        if batch:
            self._load_lists(batch)
