"""Cold (non-resident) lists streamed from host memory to the GPU tier's device and scanned
there beside Faiss's CPU scan of the rest (router: ``index_tier``; docs/architecture.md). One
batch (on a CPU the same code runs without streams)::

    producer thread   host: Faiss list rows -> pinned bounce[b]   (b = chunk % 2)
    side stream       wait scan_done[b]; bounce[b] -> staging[b] (H2D); record copy_done[b]
    compute stream    wait copy_done[b]; dense scan of staging[b]; record scan_done[b]

Rows are read from Faiss's lists under the index's shared lock (held until ``result()``); a
staged chunk is a ``Pool`` of one-row chunks, so ``dense_scan`` masks unprobed lists' rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ragserve.retrieval.tier_scan import PendingScan, Pool, canonical_topk, dense_scan, upload

STREAM_MODES = ("auto", "on", "off")
ListData = Callable[[int], tuple[np.ndarray, np.ndarray]]  # list -> (vectors [n, dim], ids [n])
Segment = tuple[int, int, int, np.ndarray, np.ndarray]  # list, first row, end row, its arrays


@dataclass(frozen=True)
class StreamConfig:
    """``mode``: ``"auto"`` (CUDA tiers), ``"on"`` (any device) or ``"off"``;
    ``host_budget_bytes``: the two pinned bounce buffers; ``stage_bytes``: one of the two device
    staging buffers; ``share``: None lets the cost model split, a number fixes the share of a
    batch's cold lists streamed (most-probed first; tests, benchmarks)."""

    mode: str = "auto"
    host_budget_bytes: int = 1 << 30
    stage_bytes: int = 256 << 20
    share: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in STREAM_MODES:
            raise ValueError(f"stream_cold must be one of {STREAM_MODES}, got {self.mode!r}")
        if self.host_budget_bytes < 1 or self.stage_bytes < 1:
            raise ValueError(
                f"host_budget_bytes and stage_bytes must be >= 1, got "
                f"{self.host_budget_bytes} and {self.stage_bytes}"
            )
        if self.share is not None and not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1] or None, got {self.share}")

    def enabled(self, device: str) -> bool:
        return self.mode == "on" or (self.mode == "auto" and device.startswith("cuda"))


@dataclass(frozen=True)
class StreamCostModel:
    """Seconds of each side of a batch's cold part (fitted by ``VectorIndex.calibrate_stream``)::

        cpu    = cpu_fixed_s + cpu_s_per_row * probed_rows / min(queries, threads)
        stream = stream_fixed_s + stream_s_per_byte * streamed_bytes

    ``probed_rows`` counts a list once per query probing it, ``streamed_bytes`` once per batch;
    ``threads``: the CPU scan's parallelism (``index_tier.scan_threads``). The split it picks
    is what runs; bench's ``StreamedLatencyModel`` prices a batch with it."""

    cpu_fixed_s: float
    cpu_s_per_row: float
    stream_fixed_s: float
    stream_s_per_byte: float
    threads: int = 1

    def __post_init__(self) -> None:
        terms = (self.cpu_fixed_s, self.cpu_s_per_row, self.stream_fixed_s, self.stream_s_per_byte)
        if min(terms) < 0 or self.threads < 1:
            raise ValueError(f"StreamCostModel needs terms >= 0 and threads >= 1, got {self}")

    def cpu_seconds(self, probed_rows: np.ndarray | float, num_queries: int) -> np.ndarray:
        par = max(1, min(int(num_queries), self.threads))
        rows = np.asarray(probed_rows, dtype=np.float64)
        return np.where(rows > 0, self.cpu_fixed_s + self.cpu_s_per_row * rows / par, 0.0)

    def stream_seconds(self, num_bytes: np.ndarray | float) -> np.ndarray:
        b = np.asarray(num_bytes, dtype=np.float64)
        return np.where(b > 0, self.stream_fixed_s + self.stream_s_per_byte * b, 0.0)


def plan_split(
    probes: np.ndarray,
    list_rows: np.ndarray,
    row_bytes: int,
    num_queries: int,
    model: StreamCostModel | None,
    share: float | None = None,
) -> np.ndarray:
    """The cold lists to stream, of ``probes`` (``[n, w]``, ``-1`` = not cold): by queries
    probing them (descending, ties by id), the ``share`` or the prefix minimising the later
    finish of the two sides under ``model`` (none without one)."""
    flat = probes[probes >= 0]
    lists, m = np.unique(flat, return_counts=True)
    if not len(lists) or (share is None and model is None):
        return np.zeros(0, np.int64)
    order = np.lexsort((lists, -m))
    lists, m = lists[order], m[order]
    if share is not None:
        return lists[: int(round(share * len(lists)))]
    rows = list_rows[lists].astype(np.float64)
    streamed = np.concatenate([[0.0], np.cumsum(rows)]) * row_bytes
    work = np.concatenate([[0.0], np.cumsum(rows * m)])
    finish = np.maximum(
        model.stream_seconds(streamed), model.cpu_seconds(work[-1] - work, num_queries)
    )
    return lists[: int(np.argmin(finish))]


class ColdStreamer:
    """Streams and scans cold lists on ``device``: ``scan`` returns a future of a
    ``PendingScan``; one producer thread runs the batches in order (the buffers need no lock).
    ``model`` and ``list_rows`` are set by the router."""

    def __init__(
        self, *, dim: int, nlist: int, is_l2: bool, device: str, config: StreamConfig
    ) -> None:
        import torch

        self._torch = torch
        self.dim, self.nlist, self.is_l2, self.config = dim, nlist, is_l2, config
        self.device = device
        self.row_bytes = dim * 4 + 8
        self.stage_rows = max(
            1, min(config.stage_bytes, config.host_budget_bytes // 2) // self.row_bytes
        )
        self._dev = torch.device(device)
        self._is_cuda = self._dev.type == "cuda"
        self._allocated = False  # the buffers come with the first batch (``_allocate``)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cold-stream")
        self._lock = threading.Lock()
        self.model: StreamCostModel | None = None
        self.list_rows = np.zeros(nlist, np.int64)
        self.reset_counts()

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes held: the bounce buffers (none on CPU or before the first batch)."""
        return 2 * self.stage_rows * self.row_bytes if self._is_cuda and self._allocated else 0

    def _allocate(self) -> None:
        """Buffers and streams, on the first batch: a tier holding every list holds none."""
        torch, dev, dim = self._torch, self._dev, self.dim
        self._vec = [torch.empty((self.stage_rows, dim), device=dev) for _ in range(2)]
        self._ids = [torch.empty(self.stage_rows, dtype=torch.int64, device=dev) for _ in range(2)]
        self._bias = [torch.zeros(self.stage_rows, device=dev) for _ in range(2)]
        if self._is_cuda:
            self._host_vec = [torch.empty_like(v, device="cpu").pin_memory() for v in self._vec]
            self._host_ids = [torch.empty_like(i, device="cpu").pin_memory() for i in self._ids]
            self._side = torch.cuda.Stream(dev)
            self._compute = torch.cuda.Stream(dev)  # NOTE: not the tier's: no head-of-line wait
            self._copy_done = [torch.cuda.Event() for _ in range(2)]
            self._scan_done = [torch.cuda.Event() for _ in range(2)]
            torch.cuda.synchronize(dev)  # NOTE: the buffers' fills precede the other streams
        self._allocated = True

    def split(self, cold: np.ndarray, num_queries: int) -> np.ndarray:
        """bool like ``cold``: the probes to stream."""
        lists = plan_split(
            cold, self.list_rows, self.row_bytes, num_queries, self.model, self.config.share
        )
        take = np.isin(cold, lists) & (cold >= 0)
        with self._lock:
            self.num_cold_probes += int((cold >= 0).sum())
            self.num_streamed_probes += int(take.sum())
        return take

    def scan(
        self, queries: np.ndarray, cluster_ids: np.ndarray, k: int, list_data: ListData
    ) -> Future:
        """Stream and scan the lists of ``cluster_ids`` (``-1``: not here); ``list_data`` must
        stay valid until the pending scan is read."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        lc = np.where(cluster_ids >= 0, cluster_ids, self.nlist).astype(np.int64)
        lists = np.unique(lc[lc < self.nlist])
        return self._pool.submit(self._run, q, lc, int(k), lists, list_data)

    def reset_counts(self) -> None:
        """Zero the counts: batches, lists and bytes streamed; the cold probes the split saw
        and those it streamed."""
        with self._lock:
            self.num_batches = self.num_lists = self.num_bytes = 0
            self.num_cold_probes = self.num_streamed_probes = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, q: np.ndarray, lc: np.ndarray, k: int, lists: np.ndarray, list_data: ListData):
        if not self._allocated:
            self._allocate()
        torch = self._torch
        dev = self._vec[0].device
        with torch.cuda.stream(self._compute) if self._is_cuda else contextlib.nullcontext():
            qd, lcd = upload(torch, q, dev), upload(torch, lc, dev)
            part_keys = [torch.full((len(q), 0), -np.inf, device=dev)]
            part_ids = [torch.full((len(q), 0), -1, dtype=torch.int64, device=dev)]
            num_bytes = 0
            for i, segments in enumerate(_chunks(lists, list_data, self.stage_rows)):
                rows, row_list = self._stage(i % 2, segments)
                num_bytes += rows * self.row_bytes
                keys, ids = self._scan_staged(i % 2, rows, row_list, qd, lcd, k)
                part_keys.append(keys)
                part_ids.append(ids)
            with self._lock:
                self.num_batches += 1
                self.num_lists += len(lists)
                self.num_bytes += num_bytes
            keys, ids = canonical_topk(
                torch, torch.cat(part_keys, 1), torch.cat(part_ids, 1), k, self.is_l2
            )
            qnorm = np.einsum("nd,nd->n", q, q) if self.is_l2 else None
            done = None
            if self._is_cuda:
                done = torch.cuda.Event()
                done.record(self._compute)
            return PendingScan(keys, ids, qnorm, done)

    def _stage(self, b: int, segments: list[Segment]) -> tuple[int, np.ndarray]:
        """Rows of ``segments`` into staging buffer ``b``: their count and each one's list."""
        torch = self._torch
        if self._is_cuda:
            self._copy_done[b].synchronize()  # NOTE: bounce[b]'s previous copy has left it
            dst_vec, dst_ids = self._host_vec[b], self._host_ids[b]
        else:
            dst_vec, dst_ids = self._vec[b], self._ids[b]
        off = 0
        row_list = []
        for c, a, e, vectors, ids in segments:
            dst_vec[off : off + e - a].copy_(torch.from_numpy(vectors[a:e]))
            dst_ids[off : off + e - a].copy_(torch.from_numpy(ids[a:e]))
            row_list.append(np.full(e - a, c, np.int64))
            off += e - a
        if self._is_cuda:
            with torch.cuda.stream(self._side):
                self._side.wait_event(self._scan_done[b])  # staging[b]'s last scan is done
                self._vec[b][:off].copy_(dst_vec[:off], non_blocking=True)
                self._ids[b][:off].copy_(dst_ids[:off], non_blocking=True)
                self._copy_done[b].record(self._side)
        return off, np.concatenate(row_list)

    def _scan_staged(self, b: int, rows: int, row_list: np.ndarray, qd, lcd, k: int):
        torch = self._torch
        if self._is_cuda:
            self._compute.wait_event(self._copy_done[b])
        vec = self._vec[b][:rows]
        bias = self._bias[b][:rows]
        if self.is_l2:
            torch.sum(vec * vec, dim=1, out=bias).neg_()
        ids, chunk_list = self._ids[b][:rows].view(rows, 1), upload(torch, row_list, vec.device)
        views = (vec.view(rows, 1, self.dim), ids, bias.view(rows, 1))  # dense reads no table
        pool = Pool(*views, None, None, None, chunk_list, None, self.nlist, rows, self.is_l2)
        keys, ids = dense_scan(torch, pool, qd, lcd, k)
        if self._is_cuda:
            self._scan_done[b].record(self._compute)
        return keys, ids


def _chunks(lists: np.ndarray, list_data: ListData, stage_rows: int) -> Iterator[list[Segment]]:
    """Segments packed into chunks of ``stage_rows`` rows (a list may span chunks)."""
    chunk: list[Segment] = []
    free = stage_rows
    for c in lists.tolist():
        vectors, ids = list_data(c)
        n = len(ids)
        a = 0
        while a < n:
            e = min(n, a + free)
            chunk.append((c, a, e, vectors, ids))
            free -= e - a
            a = e
            if free == 0:
                yield chunk
                chunk, free = [], stage_rows
    if chunk:
        yield chunk
