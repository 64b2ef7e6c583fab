"""``VectorIndex``'s GPU tier (issue 10): the router between the tier and Faiss, placing and
dropping the tier, and keeping it in step with writes. A mixin of ``VectorIndex`` (it uses the
index's ``spec``, ``_index``, ``_rw`` lock, ``access_counts`` and ``cluster_sizes``), kept in its
own file so ``index.py`` holds the index itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import faiss
import numpy as np

from ragserve.retrieval import stepwise
from ragserve.retrieval.types import ProbePlan, TopK

if TYPE_CHECKING:
    from ragserve.retrieval.gpu_tier import GpuTier
    from ragserve.retrieval.tier_placement import PlacementConfig, TierUpdater


class GpuTierMixin:
    """The GPU-tier half of ``VectorIndex`` (see the module doc)."""

    def _hybrid_scan(self, tier: GpuTier, queries: np.ndarray, plan: ProbePlan, k: int) -> TopK:
        """The router: resident probes go to the GPU tier (enqueued first, so both run at
        once), the rest to Faiss on the CPU (only rows that have any); merged exactly."""
        q = stepwise.check_queries(self._index, queries)
        if k < 1:
            raise ValueError(f"topk must be >= 1, got {k}")
        if plan.cluster_ids.shape[0] != len(q):
            raise ValueError(f"plan has {plan.cluster_ids.shape[0]} rows for {len(q)} queries")
        tier.poll()
        pending, on = tier.scan(q, plan.cluster_ids, k)
        tier.observe(plan.cluster_ids, self.access_counts.decay ** len(q))
        cpu_ids = np.where(on, -1, plan.cluster_ids)
        rows = np.flatnonzero((cpu_ids >= 0).any(1))
        part = stepwise.empty_topk(len(q), k, self.spec.is_l2)
        if len(rows):
            sub = ProbePlan(cpu_ids[rows], plan.coarse_dists[rows])
            found = stepwise.scan(self._index, q[rows], sub, k)
            part.ids[rows], part.scores[rows] = found.ids, found.scores
        if pending is None:
            return part
        return stepwise.merge(part, pending.result(), self.spec.is_l2)

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        """bool, shaped like ``cluster_ids``: which clusters the GPU tier serves right now
        (all False without a tier; ``-1`` pads are False)."""
        tier = self._tier
        if tier is None:
            return np.zeros(np.shape(cluster_ids), dtype=bool)
        return tier.resident_mask(cluster_ids)

    # -- GPU tier -------------------------------------------------------------------------------

    def set_gpu_tier(
        self,
        budget_bytes: int,
        *,
        device: str = "cuda",
        clusters: Sequence[int] | None = None,
        dtype: str = "float32",
        placement: PlacementConfig | None = None,
        scan: str = "auto",
    ) -> GpuTier:
        """Serve IVF lists from a torch ``device`` within ``budget_bytes`` (replaces any tier).

        ``clusters`` places exactly those (a `ValueError` if they exceed the budget) and pins
        them; ``None`` places the hottest lists by the live access counts (ties: lowest id
        first) and keeps re-placing them on drift in the background (``placement``). Only
        IVF-Flat lists can be placed (SQ8/PQ codes are not decoded: `ValueError`). ``float32``
        returns Faiss's results; ``float16``/``bfloat16`` halve the bytes at some recall.
        ``scan`` is the tier's scan strategy (``GpuTier.set_scan``); ``"auto"`` calibrates its
        cost model here, once the lists are placed, unless the replaced tier's model fits.
        """
        from ragserve.retrieval.gpu_tier import GpuTier
        from ragserve.retrieval.tier_placement import PlacementConfig, TierUpdater, plan_placement

        if self.spec.kind != "ivf_flat":
            raise ValueError(
                f"kind: the GPU tier holds IVF-Flat lists only, this index is {self.spec.kind!r}"
            )
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | np.integer):
            raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
        pinned = None if clusters is None else _check_clusters(clusters, self.spec.nlist)
        previous = self._tier.cost_model if self._tier is not None else None
        self.drop_gpu_tier()
        sizes = self.cluster_sizes()
        tier = GpuTier(
            dim=self.spec.dim,
            nlist=self.spec.nlist,
            metric=self.spec.metric,
            budget_bytes=int(budget_bytes),
            max_chunks=_tier_chunks(sizes if pinned is None else sizes[pinned], 256),
            device=device,
            dtype=dtype,
            scan=scan,
        )
        counts = self.access_counts.snapshot()
        placement = placement or PlacementConfig()
        if pinned is None:
            plan = plan_placement(counts, tier, sizes, placement)
            want = list(plan.cluster_ids)
        else:
            want = [int(c) for c in pinned if sizes[c] > 0]
            need = sum(tier.chunks_for(int(sizes[c])) for c in want)
            if need > tier.capacity_chunks:
                raise ValueError(
                    f"budget_bytes={budget_bytes} holds {tier.capacity_chunks} chunks of "
                    f"{tier.chunk_bytes} bytes; the given clusters need {need}"
                )
        with self._rw.read():
            for c in want:
                vectors, ids = self._list_data(c)
                tier.begin_load(c, vectors, ids, pin=False)  # copied before it returns
            tier.wait_idle()
            self._tier = tier
        if scan == "auto" and not tier.adopt_model(previous):
            tier.calibrate()
        if pinned is None:
            self._tier_updater = TierUpdater(
                tier,
                self.access_counts,
                plan,
                self._load_lists,
                self.cluster_sizes,
                placement,
            )
        return tier

    @property
    def gpu_tier(self) -> GpuTier | None:
        """The GPU tier (``clusters``, ``num_bytes``, ``hit_rate``, ``device``) or None."""
        return self._tier

    @property
    def tier_updater(self) -> TierUpdater | None:
        """The background re-placement of an unpinned tier, or None."""
        return self._tier_updater

    def drop_gpu_tier(self) -> None:
        """Serve everything from the CPU again and free the tier's device memory."""
        updater, self._tier_updater = self._tier_updater, None
        if updater is not None:
            updater.close()
        with self._rw.write():
            self._tier = None

    def _load_lists(self, clusters: Sequence[int]) -> int:
        """Start asynchronous loads of lists into the tier (the updater's callback)."""
        tier = self._tier
        if tier is None:
            return 0
        started = 0
        with self._rw.read():
            for c in clusters:
                vectors, ids = self._list_data(int(c))
                started += tier.begin_load(int(c), vectors, ids)
        return started

    def _list_data(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """List ``c``'s vectors ``[n, dim]`` float32 and ids ``[n]``, as views of Faiss's
        memory: valid while the caller holds the shared lock."""
        invlists = self._index.invlists
        n = invlists.list_size(c)
        if n == 0:
            return np.zeros((0, self.spec.dim), np.float32), np.zeros(0, np.int64)
        codes = faiss.rev_swig_ptr(invlists.get_codes(c), n * self._index.code_size)
        ids = faiss.rev_swig_ptr(invlists.get_ids(c), n)
        return codes.view(np.float32).reshape(n, self.spec.dim), ids

    def _invalidate_tier(self, lists: np.ndarray) -> None:
        """Under the exclusive lock after a write: changed lists are served by the CPU until
        the updater reloads them."""
        if self._tier is not None and len(lists):
            self._tier.invalidate(np.unique(lists).tolist())


def _check_clusters(clusters: Sequence[int], nlist: int) -> np.ndarray:
    c = np.unique(np.asarray(list(clusters), dtype=np.int64))
    if c.size and (c[0] < 0 or c[-1] >= nlist):
        raise ValueError(f"clusters must be list ids in [0, {nlist}), got {c[0]}..{c[-1]}")
    return c


def _tier_chunks(sizes: np.ndarray, chunk_size: int) -> int:
    """Chunks to hold these lists, with room for growth (upserts) of 1/8 plus one per list."""
    chunks = int(np.sum(-(-sizes // chunk_size)))
    return chunks + chunks // 8 + len(sizes)
