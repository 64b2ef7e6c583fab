"""GPU tier of an IVF-Flat index: hot inverted lists resident on a torch device (its scan
strategies, placement and figures: docs/architecture.md, "GPU tier"). Resident lists live in
one pool of fixed-size chunks (``S = chunk_size`` rows)::

    vectors [num_chunks, S, dim] (dtype)     list 17 (600 rows) -> chunks 4, 9, 2
    ids     [num_chunks, S] int64            chunk 2: rows 512..599, then 168 pads
    bias    [num_chunks, S] float32          pads: id -1, bias -inf (never ranked)

Every strategy scores ``key = a * q.x + bias`` (IP: ``a = 1``, bias 0; L2: ``a = 2``,
``bias = -|x|^2``, distance ``|q|^2 - key``) and returns each query's canonical top-k (better
score first, equal scores by id as Faiss's heaps order them) for ``stepwise.merge``.

Mutates: ``begin_load`` copies a list on a side CUDA stream; it is resident (scanned here)
once ``poll`` sees the copy done; until then, and after ``evict``/``invalidate``, the CPU
serves it. Freed chunks are reused only after the compute stream has passed every scan that
could still read them. The lock covers bookkeeping and enqueueing, never a wait on the device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragserve.retrieval.cold_stream import ColdStreamer, StreamConfig
from ragserve.retrieval.tier_assign import AssignChooser, DeviceAssigner
from ragserve.retrieval.tier_scan import (
    BUCKET_BOUNDS,
    STRATEGIES,
    GroupedPlan,
    PendingScan,
    Pool,
    ScanCostModel,
    ScanFeatures,
    ScanSample,
    dense_scan,
    fused_available,
    fused_kernel,
    fused_scan,
    fused_slices,
    fused_warm_up,
    grouped_scan,
    plan_grouped,
    upload,
)

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
SCANS = ("auto", *STRATEGIES)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CHUNK_SIZE = 256


def tier_chunk_bytes(dim: int, dtype: str = "float32", chunk_size: int = CHUNK_SIZE) -> int:
    """Bytes of one pool chunk: ``chunk_size`` rows of vector, id (int64) and bias (float32)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return chunk_size * (dim * DTYPE_BYTES[dtype] + 8 + 4)


def tier_list_bytes(
    sizes: np.ndarray, dim: int, dtype: str = "float32", chunk_size: int = CHUNK_SIZE
) -> np.ndarray:
    """Bytes each list of ``sizes`` rows takes in the pool: whole chunks (a non-empty list at
    least one; an empty list none). NOTE: the one price of a list for every picker of clusters
    within a byte budget (``plan_placement``, Algorithm 1, Eq. 2, the benches), so a chosen set
    always loads: raw ``size * row_bytes`` undercounts each list by up to a chunk."""
    rows = np.asarray(sizes, dtype=np.int64)
    chunks = np.where(rows > 0, np.maximum(1, -(-rows // chunk_size)), 0)
    return chunks * tier_chunk_bytes(dim, dtype, chunk_size)


# (batch size, share of the resident lists each query probes): small and large batches, narrow
# and wide probes, so that both strategies' terms vary
CALIBRATION_POINTS = ((1, 0.0), (1, 0.25), (16, 0.0625), (64, 0.25), (256, 0.0625))


@dataclass
class _Load:
    """A list in transit: its chunks are being written; ``event`` marks the copy's end."""

    chunks: np.ndarray
    event: Any  # torch.cuda.Event | None (CPU: done at once)
    staging: Any  # host tensors kept alive until the copy is done


class GpuTier:
    """Resident IVF lists on ``device`` within ``budget_bytes`` (see module doc).

    Public state: ``clusters`` (resident now, sorted), ``loading`` (in transit), ``num_bytes``
    (device bytes allocated), ``budget_bytes``, ``device``, ``dtype``, ``strategies`` (the scans
    ``auto`` chooses among: fused only on CUDA with Triton), ``hit_rate`` (decayed
    share of probes served here), ``streamer`` (the ``cold_stream.ColdStreamer`` that scans
    non-resident lists here too, or None; ``stream`` config), ``assigner`` (the
    ``tier_assign.DeviceAssigner`` that ``index.search`` assigns with, or None: Faiss),
    ``assign_chooser`` (``assign="auto"``: the ``tier_assign.AssignChooser`` that picks the
    assigner or Faiss per batch size, or None: always the assigner).
    Mutated by ``begin_load``/``evict``/``invalidate``/``poll``/``observe``; ``scan`` only
    reads. Thread-safe.
    """

    def __init__(
        self,
        *,
        dim: int,
        nlist: int,
        metric: str,
        budget_bytes: int,
        max_chunks: int,
        device: str = "cuda",
        dtype: str = "float32",
        chunk_size: int = 256,
        scan: str = "auto",
        stream: StreamConfig | None = None,
    ) -> None:
        import torch

        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be 'ip' or 'l2', got {metric!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_bytes = tier_chunk_bytes(dim, dtype, chunk_size)  # NOTE: checks dtype
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available (use device='cpu')")
        # NOTE: auto considers fused on CUDA only (the interpreter runs it on CPU when asked)
        can_fuse = fused_available(dev)
        self.strategies = tuple(
            s for s in STRATEGIES if s != "fused" or (can_fuse and dev.type == "cuda")
        )
        self._can_fuse = can_fuse
        self._torch = torch
        self.device = str(dev)
        self.set_scan(scan)
        self.dtype = dtype
        self.dim, self.nlist, self.is_l2 = dim, nlist, metric == "l2"
        self.chunk_size = chunk_size
        self.budget_bytes = int(budget_bytes)
        self._tdtype = getattr(torch, dtype)
        capacity = min(self.budget_bytes // self.chunk_bytes, max(int(max_chunks), 0))
        self._vectors = torch.zeros((capacity, chunk_size, dim), dtype=self._tdtype, device=dev)
        self._ids = torch.full((capacity, chunk_size), -1, dtype=torch.int64, device=dev)
        self._bias = torch.full((capacity, chunk_size), -np.inf, device=dev)
        self._is_cuda = dev.type == "cuda"
        self._side = torch.cuda.Stream(dev) if self._is_cuda else None
        self._lock = threading.RLock()
        self._free = list(range(capacity - 1, -1, -1))  # pop() takes the lowest
        self._fenced: list[tuple[Any, np.ndarray]] = []
        self._resident: dict[int, np.ndarray] = {}
        self._loading: dict[int, _Load] = {}
        self._model: ScanCostModel | None = None
        self._tried_calibration = False
        self._scan_counts = dict.fromkeys(STRATEGIES, 0)
        self._bounds = torch.from_numpy(BUCKET_BOUNDS).to(dev)
        self._rebuild_lookup()
        self._hits = 0.0
        self._probes = 0.0
        stream = stream or StreamConfig(mode="off")
        self.streamer: ColdStreamer | None = None
        self.assigner: DeviceAssigner | None = None
        self.assign_chooser: AssignChooser | None = None
        if stream.enabled(self.device):
            self.streamer = ColdStreamer(
                dim=dim, nlist=nlist, is_l2=self.is_l2, device=self.device, config=stream
            )
        if self._is_cuda:
            torch.cuda.synchronize(dev)  # NOTE: the pool's fill precedes side-stream writes

    # -- state ----------------------------------------------------------------------------------

    @property
    def capacity_chunks(self) -> int:
        return int(self._vectors.shape[0])

    @property
    def num_bytes(self) -> int:
        """Device bytes the tier's pool holds (resident, in transit and free chunks)."""
        return self.capacity_chunks * self.chunk_bytes

    @property
    def clusters(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._resident))

    @property
    def loading(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._loading))

    @property
    def num_free_chunks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def hit_rate(self) -> float:
        """Decayed share of observed probes whose list was resident (0 before any scan)."""
        with self._lock:
            return self._hits / self._probes if self._probes > 0 else 0.0

    def chunks_for(self, num_rows: int) -> int:
        return max(1, -(-int(num_rows) // self.chunk_size))

    def list_bytes(self, sizes: np.ndarray) -> np.ndarray:
        """Pool bytes of lists of ``sizes`` rows (``tier_list_bytes`` at this tier's shape)."""
        return tier_list_bytes(sizes, self.dim, self.dtype, self.chunk_size)

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        """bool, shaped like ``cluster_ids``: resident lists (``-1`` pads False)."""
        c = np.asarray(cluster_ids, dtype=np.int64)
        lookup = self._lookup
        return (c >= 0) & lookup[np.where(c >= 0, c, 0)]

    def observe(self, cluster_ids: np.ndarray, decay: float) -> None:
        """Count a batch's probes: hits (resident) and all, both decayed by ``decay``."""
        c = np.asarray(cluster_ids)
        with self._lock:
            hits = float(self.resident_mask(c).sum())
            self._hits = self._hits * decay + hits
            self._probes = self._probes * decay + float((c >= 0).sum())

    # -- placement ------------------------------------------------------------------------------

    def begin_load(
        self, cluster: int, vectors: np.ndarray, ids: np.ndarray, *, pin: bool = True
    ) -> bool:
        """Start copying list ``cluster`` (``vectors [n, dim]`` float32, ``ids [n]``) into free
        chunks on the side stream; False (nothing changes) when they do not suffice or the
        list is already resident or in transit. The caller holds the index's lock, so the
        list cannot change meanwhile (``invalidate`` cancels a load). ``pin`` stages the copy in
        pinned host memory so that it runs asynchronously (CUDA)."""
        torch = self._torch
        n = len(ids)
        if n == 0 or vectors.shape != (n, self.dim):
            return False
        num = self.chunks_for(n)
        with self._lock:
            if cluster in self._resident or cluster in self._loading or len(self._free) < num:
                return False
            chunks = np.array([self._free.pop() for _ in range(num)], dtype=np.int64)
            pad = num * self.chunk_size - n
            host_v = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
            host_i = torch.from_numpy(np.concatenate([ids, np.full(pad, -1, np.int64)]))
            if self.is_l2:
                norms = np.einsum("nd,nd->n", vectors, vectors).astype(np.float32)
                bias = np.concatenate([-norms, np.full(pad, -np.inf, np.float32)])
            else:
                bias = np.where(np.arange(n + pad) < n, 0.0, -np.inf).astype(np.float32)
            host_b = torch.from_numpy(bias)
            if self._is_cuda and pin:
                host_v, host_i, host_b = (t.pin_memory() for t in (host_v, host_i, host_b))
            event = self._write_chunks(chunks, n, host_v, host_i, host_b)
            self._loading[cluster] = _Load(chunks, event, (host_v, host_i, host_b))
        return True

    def _write_chunks(self, chunks: np.ndarray, n: int, host_v, host_i, host_b) -> Any:
        torch = self._torch
        stream = self._side
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            dev_chunks = torch.from_numpy(chunks).to(self.device, non_blocking=True)
            vec = host_v.to(self.device, non_blocking=True).to(self._tdtype)
            full = torch.zeros(
                (len(chunks) * self.chunk_size, self.dim), dtype=self._tdtype, device=self.device
            )
            full[:n] = vec
            self._vectors.index_copy_(0, dev_chunks, full.view(len(chunks), self.chunk_size, -1))
            ids = host_i.to(self.device, non_blocking=True).view(len(chunks), -1)
            self._ids.index_copy_(0, dev_chunks, ids)
            bias = host_b.to(self.device, non_blocking=True).view(len(chunks), -1)
            self._bias.index_copy_(0, dev_chunks, bias)
            if stream is None:
                return None
            event = torch.cuda.Event()
            event.record(stream)
            return event

    def evict(self, clusters: Any) -> None:
        """Stop serving lists (resident or in transit); their chunks are freed once no enqueued
        scan can read them."""
        with self._lock:
            freed = []
            for c in clusters:
                c = int(c)
                if c in self._resident:
                    freed.append(self._resident.pop(c))
                elif c in self._loading:
                    freed.append(self._loading.pop(c).chunks)
            if not freed:
                return
            self._rebuild_lookup()
            fence = None
            if self._is_cuda:
                fence = self._torch.cuda.Event()
                fence.record(self._torch.cuda.current_stream(self._vectors.device))
                # NOTE: a cancelled load may still be writing: the side stream must finish too.
                self._side.wait_event(fence)
                fence = self._torch.cuda.Event()
                fence.record(self._side)
            self._fenced.append((fence, np.concatenate(freed)))
        self.poll()

    invalidate = evict  # NOTE: same effect; named for upserts/deletes of the index

    def close(self) -> None:
        """Stop the cold-list streamer's thread (the tier is being dropped)."""
        if self.streamer is not None:
            self.streamer.close()

    def poll(self) -> None:
        """Promote finished loads to resident; return fenced chunks to the free list."""
        with self._lock:
            done = [c for c, ld in self._loading.items() if ld.event is None or ld.event.query()]
            for c in done:
                self._resident[c] = self._loading.pop(c).chunks
            keep = []
            for fence, chunks in self._fenced:
                if fence is None or fence.query():
                    self._free.extend(int(x) for x in chunks)
                else:
                    keep.append((fence, chunks))
            self._fenced = keep
            if done:
                self._rebuild_lookup()

    def wait_idle(self) -> None:
        """Block until every load and fence has completed (tests, start-up)."""
        if self._is_cuda:
            self._side.synchronize()
            self._torch.cuda.current_stream(self._vectors.device).synchronize()
        self.poll()

    def _rebuild_lookup(self) -> None:
        """Host and device tables of the resident lists (``Pool``'s doc), after any change."""
        nlist, capacity = self.nlist, self.capacity_chunks
        lookup = np.zeros(nlist, dtype=bool)
        counts = np.zeros(nlist + 1, dtype=np.int64)
        starts = np.zeros(nlist + 1, dtype=np.int64)
        chunk_list = np.full(capacity, nlist, dtype=np.int64)
        table = []
        pos = 0
        for c, chunks in self._resident.items():
            lookup[c] = True
            starts[c], counts[c] = pos, len(chunks)
            chunk_list[chunks] = c
            table.append(chunks)
            pos += len(chunks)
        table = np.concatenate(table) if table else np.zeros(0, np.int64)
        span = int(np.flatnonzero(chunk_list < nlist).max()) + 1 if pos else 0
        packed = upload(
            self._torch, np.concatenate([counts, starts, chunk_list, table]), self.device
        )
        d_counts, d_starts, d_list, d_table = packed.split([nlist + 1, nlist + 1, capacity, pos])
        # NOTE: every table is replaced, never mutated: scans already enqueued keep their own
        self._pool = Pool(
            self._vectors,
            self._ids,
            self._bias,
            d_counts,
            d_starts,
            d_table,
            d_list,
            self._bounds,
            nlist,
            span,
            self.is_l2,
        )
        self._counts_ext, self._chunk_list, self._span = counts, chunk_list, span
        self._lookup = lookup

    def check_integrity(self) -> None:
        """Every chunk is free, fenced, resident or loading, exactly once."""
        with self._lock:
            parts = [np.asarray(self._free, np.int64)]
            parts += [ch for _, ch in self._fenced]
            parts += list(self._resident.values())
            parts += [ld.chunks for ld in self._loading.values()]
            owned = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            assert np.array_equal(owned, np.arange(self.capacity_chunks)), "chunk leak"
            assert not set(self._resident) & set(self._loading), "resident and loading"
            assert self._lookup.sum() == len(self._resident), "stale lookup"
            served = np.flatnonzero(self._chunk_list < self.nlist)
            assert len(served) == sum(len(ch) for ch in self._resident.values()), "stale map"
            assert not len(served) or served.max() < self._span, "span"

    # -- scan -----------------------------------------------------------------------------------

    @property
    def scan_strategy(self) -> str:
        """``"auto"`` (the cost model picks per batch), ``"grouped"``, ``"dense"`` or
        ``"fused"``."""
        return self._scan

    def set_scan(self, strategy: str) -> None:
        """Switch the scan strategy (any time; every strategy returns the same results)."""
        if strategy not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}, got {strategy!r}")
        if strategy == "fused" and not self._can_fuse:
            fused_kernel(self.device)  # raises: what the fused scan needs
        self._scan = strategy

    @property
    def cost_model(self) -> ScanCostModel | None:
        """The calibrated model ``scan="auto"`` uses (None before the first calibration)."""
        return self._model

    @property
    def model_setting(self) -> tuple:
        """What a cost model measured here transfers to: device, dtype, metric and shapes."""
        return (self.device, self.dtype, self.is_l2, self.dim, self.chunk_size)

    def adopt_model(self, model: ScanCostModel | None) -> bool:
        """Use ``model`` (e.g. the replaced tier's) instead of calibrating, if it fits this
        tier (``ScanCostModel.fits``); False (nothing changes) otherwise."""
        if model is None or not model.fits(self.model_setting, self._span * self.chunk_size):
            return False
        self._model = model
        return True

    @property
    def scan_counts(self) -> dict[str, int]:
        """Scans run so far by each strategy."""
        with self._lock:
            return dict(self._scan_counts)

    def scan(
        self, queries: np.ndarray, cluster_ids: np.ndarray, k: int, strategy: str | None = None
    ) -> tuple[PendingScan | None, np.ndarray]:
        """Enqueue the scan of every resident list in ``cluster_ids`` (``[n, w]``, ``-1`` pads)
        for ``queries`` (``[n, dim]`` float32). Returns the pending result (``None`` when no
        probe is resident) and the mask of the probes it covers: the caller scans the rest.
        ``scan="auto"`` calibrates its cost model first (outside the lock) if it has none and
        has not tried yet with lists resident; without a model it scans grouped. ``strategy``
        overrides the tier's strategy for this call."""
        cids = np.asarray(cluster_ids, dtype=np.int64)
        untried = self._model is None and not self._tried_calibration
        if self._scan == "auto" and untried and self.resident_mask(cids).any():
            self.calibrate()
        with self._lock:
            on = self.resident_mask(cids)
            if not on.any():
                return None, on
            q = np.ascontiguousarray(queries, np.float32)
            lc = np.where(on, cids, self.nlist)
            return self._enqueue(q, lc, int(k), strategy or self._scan), on

    def features(self, num_queries: int, plan: GroupedPlan) -> ScanFeatures:
        """What each strategy would read for a batch whose grouped shapes are ``plan``."""
        size = self.chunk_size
        return ScanFeatures(
            num_queries, self._span * size, plan.num_runs * size, plan.num_slots * size
        )

    def _enqueue(
        self, q: np.ndarray, lc: np.ndarray, k: int, strategy: str, span: int | None = None
    ) -> PendingScan:
        """Under the lock: ``lc`` = probed list ids with ``nlist`` for every probe not served
        here; ``strategy`` as ``set_scan`` (auto resolved here); ``span`` (calibration only)
        cuts the dense scan's span to its first ``span`` chunks."""
        torch = self._torch
        plan = None if strategy == "dense" else plan_grouped(lc, self._counts_ext)
        if strategy == "auto":
            model = self._model
            strategy = "grouped" if model is None else model.choose(self.features(len(q), plan))
        dev = self._vectors.device
        qd = upload(torch, q, dev).to(self._tdtype)
        lcd = upload(torch, lc, dev)
        pool = self._pool if span is None else self._pool._replace(span=span)
        if strategy == "dense":
            keys, ids = dense_scan(torch, pool, qd, lcd, k)
        elif strategy == "fused":
            parts = [
                fused_scan(torch, pool, qd[a:b], lcd[a:b], part, k)
                for a, b, part in fused_slices(lc, self._counts_ext, plan, self.chunk_size)
            ]
            keys = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            ids = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        else:
            keys, ids = grouped_scan(torch, pool, qd, lcd, plan, k)
        self._scan_counts[strategy] += 1
        qnorm = np.einsum("nd,nd->n", q, q) if self.is_l2 else None
        return PendingScan(keys, ids, qnorm)

    def calibrate(
        self,
        points: Sequence[tuple[int, float]] = CALIBRATION_POINTS,
        *,
        repeats: int = 2,
        seed: int = 0,
    ) -> ScanCostModel | None:
        """Fit the cost model of ``scan="auto"`` from timed scans of random resident probes:
        per point ``(batch size, share of the resident lists each query probes)`` (at least one
        list), each strategy's median of ``repeats`` after one warm-up. None (no model) when
        nothing is resident. Waits for the device, never under the lock."""
        if repeats < 1 or len(points) < 3 or min(n for n, _ in points) < 1:
            raise ValueError(f"points: >= 3 with batch >= 1 and repeats >= 1, got {points}")
        resident = np.asarray(self.clusters, dtype=np.int64)
        if not len(resident):
            return None
        self._tried_calibration = True
        if "fused" in self.strategies:
            with self._lock:
                fused_warm_up(self._torch, self._pool)
        rng = np.random.default_rng(seed)
        samples = []
        for n, share in points:
            w = min(len(resident), max(1, int(np.ceil(share * len(resident)))))
            q = rng.standard_normal((n, self.dim)).astype(np.float32)
            lc = rng.permuted(np.tile(resident, (n, 1)), axis=1)[:, :w]
            seconds, features = {}, None
            for strategy in self.strategies:
                seconds[strategy], features = self._time(strategy, q, lc, repeats)
            if features is not None and np.isfinite(list(seconds.values())).all():
                samples.append(ScanSample(features, seconds))
            half = self._span // 2
            if n > 1 and half > 0:  # NOTE: a second span, so that d0 and d1 are told apart
                dense, features = self._time("dense", q, lc, repeats, half)
                if features is not None and np.isfinite(dense):
                    samples.append(ScanSample(features, {"dense": dense}))
        if sum("grouped" in sample.seconds for sample in samples) < 3:
            return None
        self._model = ScanCostModel.fit(samples, self.model_setting, self._span * self.chunk_size)
        logger.info("scan cost model calibrated: %s", self._model)
        return self._model

    def _time(
        self, strategy: str, q: np.ndarray, lc: np.ndarray, repeats: int, span: int | None = None
    ) -> tuple[float, ScanFeatures | None]:
        """Median seconds of a scan (enqueue to result) and its features; (inf, None) when its
        lists left the tier meanwhile. ``span``: as ``_enqueue`` (its rows in the features)."""
        times, features = [], None
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with self._lock:
                live = np.where(self._lookup[lc], lc, self.nlist)
                if (live == self.nlist).all():
                    return np.inf, None
                features = self.features(len(q), plan_grouped(live, self._counts_ext))
                if span is not None:
                    span = min(span, self._span)
                    features = features._replace(span_rows=span * self.chunk_size)
                pending = self._enqueue(q, live, 10, strategy, span)
            pending.result()
            times.append(time.perf_counter() - t0)
        with self._lock:
            self._scan_counts[strategy] -= repeats + 1  # NOTE: calibration is not serving
        return float(np.median(times[1:])), features
