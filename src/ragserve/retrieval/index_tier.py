"""``VectorIndex``'s GPU tier (a mixin of it, using its ``spec``, ``_index``, ``_rw`` lock,
``access_counts`` and ``cluster_sizes``): the router between the tier and Faiss, placing and
dropping the tier, and keeping it in step with writes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import faiss
import numpy as np

import ragserve.retrieval.stepwise as stepwise
from ragserve.retrieval.types import ProbePlan, TopK

if TYPE_CHECKING:
    from ragserve.retrieval.cold_stream import ColdStreamer, StreamConfig, StreamCostModel
    from ragserve.retrieval.gpu_tier import GpuTier
    from ragserve.retrieval.partition import PlacementConfig, TierUpdater


class TierSpec(NamedTuple):
    """A tier's ``set_gpu_tier`` arguments as data (crosses to workers, actors and shards)."""

    budget_bytes: int
    device: str = "cuda"
    dtype: str = "float32"
    scan: str = "auto"
    stream_cold: str = "auto"
    stream_host_bytes: int = 1 << 30

    def place(self, index: Any) -> Any:
        return index.set_gpu_tier(
            int(self.budget_bytes),
            device=self.device,
            dtype=self.dtype,
            scan=self.scan,
            stream_cold=self.stream_config(),
        )

    def stream_config(self) -> StreamConfig:
        from ragserve.retrieval.cold_stream import StreamConfig

        return StreamConfig(mode=self.stream_cold, host_budget_bytes=int(self.stream_host_bytes))


# (queries, cold lists per query) of the stream's calibration: both sides' terms vary
STREAM_POINTS = ((4, 4), (16, 8), (32, 16), (64, 32))
ASSIGNS = ("auto", "tier", "faiss")  # where ``search`` assigns queries (``set_gpu_tier``)


class GpuTierMixin:
    def _locked_scan(
        self, queries: np.ndarray, plan: ProbePlan, k: int, strategy: str | None = None
    ) -> TopK:
        """Under the shared lock: without a tier, Faiss's scan; with one, the resident probes to
        the tier (enqueued first, so all run at once), the streamer's share of the rest to it,
        the others to Faiss, merged exactly."""
        tier = self._tier
        if tier is None:
            return stepwise.scan(self._index, queries, plan, k)
        q = stepwise.check_queries(self._index, queries)
        if k < 1:
            raise ValueError(f"topk must be >= 1, got {k}")
        if plan.cluster_ids.shape[0] != len(q):
            raise ValueError(f"plan has {plan.cluster_ids.shape[0]} rows for {len(q)} queries")
        tier.poll()
        pending, on = tier.scan(q, plan.cluster_ids, k, strategy)
        tier.observe(plan.cluster_ids, self.access_counts.decay ** len(q))
        cpu_ids = np.where(on, -1, plan.cluster_ids)
        streamed = None
        if tier.streamer is not None and (cpu_ids >= 0).any():
            streamed, cpu_ids = self._stream_cold(tier.streamer, q, cpu_ids, k)
        rows = np.flatnonzero((cpu_ids >= 0).any(1))
        if pending is not None and streamed is None and not len(rows):
            return pending.result()  # NOTE: every probe on the tier: nothing to merge
        part = stepwise.empty_topk(len(q), k, self.spec.is_l2)
        try:
            if len(rows):
                sub = ProbePlan(cpu_ids[rows], plan.coarse_dists[rows])
                found = stepwise.scan(self._index, q[rows], sub, k)
                part.ids[rows], part.scores[rows] = found.ids, found.scores
        finally:  # NOTE: the stream reads Faiss's lists: done before the shared lock is let go
            streamed_scan = None if streamed is None else streamed.result()
        for side in (pending, streamed_scan):
            if side is not None:
                part = stepwise.merge(part, side.result(), self.spec.is_l2)
        return part

    def _tier_search(self, queries: np.ndarray, topk: int, nprobe: int | None) -> TopK | None:
        """``search`` assigning on the tier's device (``tier_assign``); None without an
        assigner."""
        tier = self._tier
        assigner = None if tier is None else tier.assigner
        if assigner is None:
            return None
        q = stepwise.check_queries(self._index, queries)
        nprobe = nprobe or self.spec.nprobe
        chooser = tier.assign_chooser
        path = "tier" if chooser is None else chooser.choose(len(q))
        t0 = time.perf_counter()
        if path == "faiss":
            found = self.scan(q, self.assign(q, nprobe), topk)
        else:
            split = assigner.assign(q, nprobe)
            found = self.scan(q, split.sure, topk)
            rows, band = split.band_rows, None
            if len(rows):  # the band's few lists per row, grouped (dense would read every row)
                with self._rw.read():
                    band = self._locked_scan(q[rows], split.band, topk, strategy="grouped")
            redo = assigner.settle(split, found, band)
            if len(redo):
                again = self.scan(q[redo], self.assign(q[redo], nprobe), topk)
                found.ids[redo], found.scores[redo] = again.ids, again.scores
        if chooser is not None:
            chooser.record(len(q), path, time.perf_counter() - t0)
        return found

    def _stream_cold(
        self, streamer: ColdStreamer, q: np.ndarray, cold: np.ndarray, k: int
    ) -> tuple[Future | None, np.ndarray]:
        """Start streaming the split's share of ``cold`` (``-1``: none); returns its future
        (None: nothing streamed) and the probes left."""
        if streamer.model is None and streamer.config.share is None:
            self._calibrate_stream(STREAM_POINTS, 2, 0, None)
        take = streamer.split(cold, len(q))
        if not take.any():
            return None, cold
        future = streamer.scan(q, np.where(take, cold, -1), k, self._list_data)
        return future, np.where(take, -1, cold)

    def calibrate_stream(
        self,
        *,
        points: Sequence[tuple[int, int]] = STREAM_POINTS,
        repeats: int = 2,
        seed: int = 0,
        threads: int | None = None,
    ) -> StreamCostModel | None:
        """Fit the streamer's ``StreamCostModel`` from random cold lists scanned streamed and on
        the CPU at once, at ``points`` (queries, lists per query), medians of ``repeats``; None
        without a streamer or cold lists. ``threads``: the CPU parallelism assumed (None:
        ``scan_threads``). A search calibrates on first use otherwise."""
        with self._rw.read():
            return self._calibrate_stream(points, repeats, seed, threads)

    def _calibrate_stream(self, points, repeats: int, seed: int, threads: int | None):
        from ragserve.retrieval.cold_stream import StreamCostModel
        from ragserve.retrieval.tier_scan import nnls_relative

        tier = self._tier
        streamer = None if tier is None else tier.streamer
        if streamer is None:
            return None
        sizes = self._list_sizes()
        streamer.list_rows = sizes
        cold = np.flatnonzero((sizes > 0) & ~tier.resident_mask(np.arange(self.spec.nlist)))
        if not len(cold):
            return None
        rng = np.random.default_rng(seed)
        real = threads is None and self._index.parallel_mode & ~stepwise.NO_HEAP_INIT == 0
        threads = scan_threads(self._index) if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        cpu, stream = [], []  # per point: (1, rows or bytes, seconds) of each side
        for n, w in points:
            w = min(w, len(cold))
            probes = np.stack([rng.choice(cold, w, replace=False) for _ in range(n)])
            q = rng.standard_normal((n, self.spec.dim)).astype(np.float32)
            sub = ProbePlan(probes, np.zeros(probes.shape, np.float32))
            on_cpu = functools.partial(stepwise.scan, self._index, q, sub, 10)
            on_stream = functools.partial(streamer.scan, q, probes, 10, self._list_data)
            cpu_s, stream_s = _concurrent_seconds(on_cpu, on_stream, repeats)
            # NOTE: the threads this point's scan really had (a small one is not split), so
            # `c1` is one core's cost of a row; the model then prices min(queries, threads).
            par = stepwise.split_threads(self._index, n, w) if real else max(1, min(n, threads))
            cpu.append((1.0, sizes[probes].sum() / par, cpu_s))
            stream.append((1.0, sizes[np.unique(probes)].sum() * streamer.row_bytes, stream_s))
        cpu, stream = np.array(cpu), np.array(stream)
        c0, c1 = nnls_relative(cpu[:, :2], cpu[:, 2])
        s0, s1 = nnls_relative(stream[:, :2], stream[:, 2])
        streamer.model = StreamCostModel(c0, c1, s0, s1, threads)
        streamer.reset_counts()
        return streamer.model

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        """bool like ``cluster_ids``: the lists the tier serves now."""
        tier = self._tier
        if tier is None:
            return np.zeros(np.shape(cluster_ids), dtype=bool)
        return tier.resident_mask(cluster_ids)

    def set_gpu_tier(
        self,
        budget_bytes: int,
        *,
        device: str = "cuda",
        clusters: Sequence[int] | None = None,
        dtype: str = "float32",
        placement: PlacementConfig | None = None,
        scan: str = "auto",
        stream_cold: str | StreamConfig = "auto",
        assign: str = "faiss",
    ) -> GpuTier:
        """Serve IVF-Flat lists from ``device`` within ``budget_bytes`` (replaces any tier).
        ``clusters`` pins exactly those; None places the hottest and re-places them on drift
        (``placement``). Options: docs/architecture.md, "GPU tier"."""
        from ragserve.retrieval.cold_stream import StreamConfig
        from ragserve.retrieval.gpu_tier import GpuTier, headroom_chunks
        from ragserve.retrieval.partition import PlacementConfig, TierUpdater, plan_placement

        check_tier_options(self.spec.kind, budget_bytes, scan, stream_cold)
        if assign not in ASSIGNS:
            raise ValueError(f"assign must be one of {ASSIGNS}, got {assign!r}")
        if isinstance(stream_cold, str):
            stream_cold = StreamConfig(mode=stream_cold)
        pinned = None if clusters is None else _check_clusters(clusters, self.spec.nlist)
        previous = self._tier.cost_model if self._tier is not None else None
        self.drop_gpu_tier()
        sizes = self.cluster_sizes()
        tier = GpuTier(
            dim=self.spec.dim,
            nlist=self.spec.nlist,
            is_l2=self.spec.is_l2,
            budget_bytes=int(budget_bytes),
            max_chunks=headroom_chunks(sizes if pinned is None else sizes[pinned]),
            device=device,
            dtype=dtype,
            scan=scan,
            stream=stream_cold,
        )
        if tier.streamer is not None:
            tier.streamer.list_rows = sizes
        # NOTE: the device scores every centroid, so only an exact (flat) quantizer qualifies
        is_flat = isinstance(faiss.downcast_index(self._index.quantizer), faiss.IndexFlat)
        if is_flat and assign in ("tier", "auto"):
            import torch

            from ragserve.retrieval.tier_assign import AssignChooser, DeviceAssigner

            centroids = self._index.quantizer.reconstruct_n(0, self.spec.nlist)
            tier.assigner = DeviceAssigner(torch, centroids, self.spec.is_l2, tier.device)
            if assign == "auto":
                tier.assign_chooser = AssignChooser()
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
            self._begin_loads(tier, want, pin=False)  # copied before it returns
            tier.wait_idle()
            self._tier = tier
        if scan == "auto" and not tier.adopt_model(previous):
            tier.calibrate()
        if pinned is None:
            self._tier_updater = TierUpdater(
                tier, self.access_counts, plan, self._load_lists, self.cluster_sizes, placement
            )
        return tier

    @property
    def gpu_tier(self) -> GpuTier | None:
        return self._tier

    @property
    def tier_updater(self) -> TierUpdater | None:
        return self._tier_updater

    def drop_gpu_tier(self) -> None:
        updater, self._tier_updater = self._tier_updater, None
        if updater is not None:
            updater.close()
        with self._rw.write():
            tier, self._tier = self._tier, None
        if tier is not None:
            tier.close()

    def _load_lists(self, clusters: Sequence[int]) -> int:
        tier = self._tier
        if tier is None:
            return 0
        with self._rw.read():
            return self._begin_loads(tier, clusters)

    def _begin_loads(self, tier: GpuTier, clusters: Sequence[int], *, pin: bool = True) -> int:
        """Start loading ``clusters`` into ``tier`` (under the shared lock); how many started."""
        return sum(tier.begin_load(int(c), *self._list_data(int(c)), pin=pin) for c in clusters)

    def _list_data(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """List ``c``'s vectors and ids: views of Faiss's memory, valid under the lock."""
        invlists = self._index.invlists
        n = invlists.list_size(c)
        if n == 0:
            return np.zeros((0, self.spec.dim), np.float32), np.zeros(0, np.int64)
        codes = faiss.rev_swig_ptr(invlists.get_codes(c), n * self._index.code_size)
        ids = faiss.rev_swig_ptr(invlists.get_ids(c), n)
        return codes.view(np.float32).reshape(n, self.spec.dim), ids

    def _invalidate_tier(self, lists: np.ndarray) -> None:
        """After a write (exclusive lock): the CPU serves changed lists until reloaded."""
        if self._tier is not None and len(lists):
            changed = np.unique(lists)
            self._tier.invalidate(changed.tolist())
            if self._tier.streamer is not None:  # NOTE: sizes only price the split
                rows = self._tier.streamer.list_rows.copy()
                rows[changed] = [self._index.invlists.list_size(int(c)) for c in changed]
                self._tier.streamer.list_rows = rows


def check_tier_options(
    kind: str, budget_bytes: int, scan: str, stream_cold: str | StreamConfig
) -> None:
    """A one-line `ValueError` for bad tier options, before anything moves."""
    from ragserve.retrieval.cold_stream import StreamConfig
    from ragserve.retrieval.gpu_tier import SCANS

    if kind != "ivf_flat":
        raise ValueError(f"kind: the GPU tier holds IVF-Flat lists only, this index is {kind!r}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | np.integer):
        raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
    if isinstance(stream_cold, str):
        StreamConfig(mode=stream_cold)  # raises naming the modes
    elif not isinstance(stream_cold, StreamConfig):
        raise ValueError(f"stream_cold must be a mode or a StreamConfig, got {stream_cold!r}")


def scan_threads(index: faiss.IndexIVF) -> int:
    """The CPU scan's parallelism: ``stepwise.scan_threads()``, or Faiss's OpenMP threads for
    an index in a ``parallel_mode`` other than 0 (Faiss spreads that one call)."""
    if index.parallel_mode & ~stepwise.NO_HEAP_INIT == 0:
        return stepwise.scan_threads()
    return max(1, int(faiss.omp_get_max_threads()))


def _concurrent_seconds(
    on_cpu: Callable[[], object], on_stream: Callable[[], Future], repeats: int
) -> tuple[float, float]:
    """Median seconds of each side started together (after a warm-up), each to its own end:
    the CPU scan here, the stream's on a waiter thread."""

    def finish(future: Future, t0: float) -> float:
        future.result().result()
        return time.perf_counter() - t0

    times = []
    with ThreadPoolExecutor(1, thread_name_prefix="stream-calibration") as waiter:
        for _ in range(max(1, repeats) + 1):
            t0 = time.perf_counter()
            stream = waiter.submit(finish, on_stream(), t0)
            on_cpu()
            times.append((time.perf_counter() - t0, stream.result()))  # re-raises its error
    cpu, stream = np.median(np.array(times[1:]), axis=0)
    return float(cpu), float(stream)


def _check_clusters(clusters: Sequence[int], nlist: int) -> np.ndarray:
    c = np.unique(np.asarray(list(clusters), dtype=np.int64))
    if c.size and (c[0] < 0 or c[-1] >= nlist):
        raise ValueError(f"clusters must be list ids in [0, {nlist}), got {c[0]}..{c[-1]}")
    return c
