"""GPU tier of an IVF-Flat index: hot inverted lists resident on a torch device, in one pool of
fixed-size chunks (``S = chunk_size`` rows; strategies and figures: docs/architecture.md)::

    vectors [num_chunks, S, dim] (dtype)     list 17 (600 rows) -> chunks 4, 9, 2
    ids     [num_chunks, S] int64            chunk 2: rows 512..599, then 168 pads
    bias    [num_chunks, S] float32          pads: id -1, bias -inf (never ranked)

A scan scores ``key = a * q.x + bias`` (IP: ``a = 1``, bias 0; L2: ``a = 2``, ``bias = -|x|^2``,
distance ``|q|^2 - key``). A list being copied (side stream) is served by the CPU until ``poll``
sees the copy done; freed chunks are reused only once no enqueued scan can read them. The
lock covers bookkeeping and enqueueing, never a wait on the device.
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

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPES = tuple(DTYPE_BYTES)
SCANS = ("auto", *STRATEGIES)
CHUNK_SIZE = 256


def tier_chunk_bytes(dim: int, dtype: str = "float32") -> int:
    """Bytes of one pool chunk: ``CHUNK_SIZE`` rows of vector, int64 id and float32 bias."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return CHUNK_SIZE * (dim * DTYPE_BYTES[dtype] + 8 + 4)


def tier_list_bytes(sizes: np.ndarray, dim: int, dtype: str = "float32") -> np.ndarray:
    """Pool bytes of lists of ``sizes`` rows (whole chunks). NOTE: the one price of a list for
    every picker within a byte budget, so a chosen set always loads."""
    rows = np.asarray(sizes, dtype=np.int64)
    chunks = np.where(rows > 0, np.maximum(1, -(-rows // CHUNK_SIZE)), 0)
    return chunks * tier_chunk_bytes(dim, dtype)


def headroom_chunks(sizes: np.ndarray) -> int:
    """Chunks to hold lists of ``sizes`` rows, with room for upserts: 1/8 plus one per list."""
    chunks = int(np.sum(-(-sizes // CHUNK_SIZE)))
    return chunks + chunks // 8 + len(sizes)


# (batch size, share of the resident lists each query probes): every strategy's terms vary
CALIBRATION_POINTS = ((1, 0.0), (1, 0.25), (16, 0.0625), (64, 0.25), (256, 0.0625))


@dataclass
class _Load:
    """A list in transit; ``event`` marks the copy's end."""

    chunks: np.ndarray
    event: Any  # torch.cuda.Event | None (CPU: done at once)
    staging: Any  # host tensors kept alive until the copy is done


class GpuTier:
    """Resident IVF lists on ``device`` within ``budget_bytes`` (module doc): ``clusters``
    (sorted), ``loading``, ``num_bytes``, ``strategies`` (what ``auto`` chooses among), decayed
    ``hit_rate``, ``streamer`` (``ColdStreamer`` or None), ``assigner`` / ``assign_chooser``
    (``tier_assign``, or None: Faiss assigns). Mutated by ``begin_load``/``evict``/``poll``/
    ``observe``; ``scan`` only reads. Thread-safe.
    """

    def __init__(
        self,
        *,
        dim: int,
        nlist: int,
        is_l2: bool,
        budget_bytes: int,
        max_chunks: int,
        device: str = "cuda",
        dtype: str = "float32",
        scan: str = "auto",
        stream: StreamConfig | None = None,
    ) -> None:
        import torch

        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.chunk_bytes = tier_chunk_bytes(dim, dtype)  # NOTE: checks dtype
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available (use device='cpu')")
        self._torch, self.device, self._is_cuda = torch, str(dev), dev.type == "cuda"
        self._can_fuse = fused_available(dev)
        # NOTE: auto considers fused on CUDA only (the interpreter runs it on CPU when asked)
        fuse = self._can_fuse and self._is_cuda
        self.strategies = tuple(s for s in STRATEGIES if s != "fused" or fuse)
        self.set_scan(scan)
        self.dim, self.nlist, self.is_l2, self.dtype = dim, nlist, bool(is_l2), dtype
        self.chunk_size = size = CHUNK_SIZE
        self.budget_bytes = int(budget_bytes)
        self._tdtype = getattr(torch, dtype)
        capacity = min(self.budget_bytes // self.chunk_bytes, max(int(max_chunks), 0))
        self._vectors = torch.zeros((capacity, size, dim), dtype=self._tdtype, device=dev)
        self._ids = torch.full((capacity, size), -1, dtype=torch.int64, device=dev)
        self._bias = torch.full((capacity, size), -np.inf, device=dev)
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
        self._hits = self._probes = 0.0
        self.assigner: DeviceAssigner | None = None
        self.assign_chooser: AssignChooser | None = None
        self.streamer: ColdStreamer | None = None
        if stream is not None and stream.enabled(self.device):
            self.streamer = ColdStreamer(
                dim=dim, nlist=nlist, is_l2=self.is_l2, device=self.device, config=stream
            )
        if self._is_cuda:
            torch.cuda.synchronize(dev)  # NOTE: the pool's fill precedes side-stream writes

    @property
    def capacity_chunks(self) -> int:
        return int(self._vectors.shape[0])

    @property
    def num_bytes(self) -> int:
        """Device bytes of the pool (resident, in transit and free chunks)."""
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
        with self._lock:
            return self._hits / self._probes if self._probes > 0 else 0.0

    def chunks_for(self, num_rows: int) -> int:
        return max(1, -(-int(num_rows) // self.chunk_size))

    def list_bytes(self, sizes: np.ndarray) -> np.ndarray:
        return tier_list_bytes(sizes, self.dim, self.dtype)

    def resident_mask(self, cluster_ids: np.ndarray) -> np.ndarray:
        c = np.asarray(cluster_ids, dtype=np.int64)
        lookup = self._lookup
        return (c >= 0) & lookup[np.where(c >= 0, c, 0)]

    def observe(self, cluster_ids: np.ndarray, decay: float) -> None:
        c = np.asarray(cluster_ids)
        with self._lock:
            hits = float(self.resident_mask(c).sum())
            self._hits = self._hits * decay + hits
            self._probes = self._probes * decay + float((c >= 0).sum())

    def begin_load(
        self, cluster: int, vectors: np.ndarray, ids: np.ndarray, *, pin: bool = True
    ) -> bool:
        """Start copying list ``cluster`` into free chunks on the side stream (``pin``: from
        pinned memory, asynchronously); False (nothing changes) when they do not suffice or it
        is resident or in transit. The caller holds the index's lock (writes ``invalidate``)."""
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
            host_v = torch.from_numpy(np.pad(np.asarray(vectors, np.float32), ((0, pad), (0, 0))))
            host_i = torch.from_numpy(np.concatenate([ids, np.full(pad, -1, np.int64)]))
            if self.is_l2:
                norms = np.einsum("nd,nd->n", vectors, vectors).astype(np.float32)
                bias = np.concatenate([-norms, np.full(pad, -np.inf, np.float32)])
            else:
                bias = np.where(np.arange(n + pad) < n, 0.0, -np.inf).astype(np.float32)
            host_b = torch.from_numpy(bias)
            if self._is_cuda and pin:
                host_v, host_i, host_b = (t.pin_memory() for t in (host_v, host_i, host_b))
            event = self._write_chunks(chunks, host_v, host_i, host_b)
            self._loading[cluster] = _Load(chunks, event, (host_v, host_i, host_b))
        return True

    def _write_chunks(self, chunks: np.ndarray, host_v, host_i, host_b) -> Any:
        """Copy padded host rows into ``chunks`` (on the side stream on CUDA); the copy's end
        event, or None."""
        torch = self._torch
        stream = self._side
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dev_chunks = torch.from_numpy(chunks).to(self.device, non_blocking=True)
            for pool, host in ((self._vectors, host_v), (self._ids, host_i), (self._bias, host_b)):
                rows = host.to(self.device, non_blocking=True).to(pool.dtype)
                pool.index_copy_(0, dev_chunks, rows.view(len(chunks), *pool.shape[1:]))
            if stream is None:
                return None
            event = torch.cuda.Event()
            event.record(stream)
            return event

    def evict(self, clusters: Any) -> None:
        """Stop serving lists; their chunks are freed once no enqueued scan can read them."""
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
        if self._is_cuda:
            self._side.synchronize()
            self._torch.cuda.current_stream(self._vectors.device).synchronize()
        self.poll()

    def _rebuild_lookup(self) -> None:
        nlist, capacity, dev = self.nlist, self.capacity_chunks, self.device
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
        packed = upload(self._torch, np.concatenate([counts, starts, table, chunk_list]), dev)
        tables = packed.split([nlist + 1, nlist + 1, pos, capacity])
        # NOTE: every table is replaced, never mutated: scans already enqueued keep their own
        pool = (self._vectors, self._ids, self._bias, *tables, self._bounds, nlist, span)
        self._pool = Pool(*pool, self.is_l2)
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

    @property
    def scan_strategy(self) -> str:
        return self._scan

    def set_scan(self, strategy: str) -> None:
        """Any time: every strategy returns the same results."""
        if strategy not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}, got {strategy!r}")
        if strategy == "fused" and not self._can_fuse:
            fused_kernel(self.device)  # raises: what the fused scan needs
        self._scan = strategy

    @property
    def cost_model(self) -> ScanCostModel | None:
        return self._model

    @property
    def model_setting(self) -> tuple:
        return (self.device, self.dtype, self.is_l2, self.dim, self.chunk_size)

    def adopt_model(self, model: ScanCostModel | None) -> bool:
        """Use ``model`` (the replaced tier's) if it ``fits`` this tier; else False."""
        if model is None or not model.fits(self.model_setting, self._span * self.chunk_size):
            return False
        self._model = model
        return True

    @property
    def scan_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._scan_counts)

    def scan(
        self, queries: np.ndarray, cluster_ids: np.ndarray, k: int, strategy: str | None = None
    ) -> tuple[PendingScan | None, np.ndarray]:
        """Enqueue the scan of the resident probes of ``cluster_ids`` (``[n, w]``, ``-1`` pads);
        returns the pending result (None: no probe resident) and the mask of the probes it
        covers. ``auto`` calibrates first (outside the lock) if it never tried; without a
        model it scans grouped. ``strategy`` overrides the tier's for this call."""
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
        size = self.chunk_size
        return ScanFeatures(
            num_queries, self._span * size, plan.num_runs * size, plan.num_slots * size
        )

    def _enqueue(
        self, q: np.ndarray, lc: np.ndarray, k: int, strategy: str, span: int | None = None
    ) -> PendingScan:
        """Under the lock: ``lc`` = probed lists, ``nlist`` where not served here; ``span``
        (calibration) cuts the dense scan to its first ``span`` chunks."""
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
            keys, ids = (torch.cat(side) for side in zip(*parts, strict=True))
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
        """Fit ``auto``'s cost model from timed scans of random resident probes at ``points``
        ``(batch size, share of the resident lists each query probes)``, medians of ``repeats``
        after a warm-up; None when nothing is resident. Never waits under the lock."""
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
        """Median seconds (enqueue to result) and features; (inf, None) when the lists left."""
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
