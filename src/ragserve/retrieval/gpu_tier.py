"""GPU tier of an IVF-Flat index: hot inverted lists resident on a torch device (HedraRAG §4.4;
VectorLiteRAG's splitter and router without separate shard indexes).

Resident lists live in one pool of fixed-size chunks (``S = chunk_size`` rows)::

    vectors [num_chunks, S, dim] (dtype)     list 17 (600 rows) -> chunks 4, 9, 2
    ids     [num_chunks, S] int64            chunk 2: rows 512..599, then 168 pads
    bias    [num_chunks, S] float32          pads: id -1, bias -inf (never ranked)

A scan turns (query, probed resident list) pairs into (query, chunk) pairs, groups them by chunk,
and scores groups of chunks probed by similar numbers of queries with one ``bmm``:
``key = a * q.x + bias`` (IP: ``a = 1``, bias 0; L2: ``a = 2``, ``bias = -|x|^2``, and the
distance is ``|q|^2 - key``). Each (query, chunk) keeps its top-k; each query then keeps the
canonical top-k of its candidates (better score first, equal scores by id as Faiss's heaps
order them), which `stepwise.merge` combines with the CPU-scanned lists.

Swaps: ``begin_load`` copies a list into free chunks on a side CUDA stream; the list becomes
resident (scanned here) only once that copy has completed (``poll``); until then, and after
``evict``/``invalidate``, the CPU serves it. Freed chunks are reused only after the compute
stream has passed every scan that could still read them. The tier's lock covers bookkeeping
and the enqueueing of a scan's kernels, never a wait on the device.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragserve.retrieval.types import TopK

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
MAX_GROUP_SCORES = 1 << 26  # (query, row) scores of one bmm group
MAX_GROUP_BYTES = 1 << 29  # vector bytes gathered for one bmm group


@dataclass
class _Load:
    """A list in transit: its chunks are being written; ``event`` marks the copy's end."""

    chunks: np.ndarray
    event: Any  # torch.cuda.Event | None (CPU: done at once)
    staging: Any  # host tensors kept alive until the copy is done


class PendingScan:
    """A scan whose kernels are enqueued; ``result()`` waits for them and returns the TopK."""

    def __init__(self, keys: Any, ids: Any, qnorm: np.ndarray | None) -> None:
        self._keys, self._ids, self._qnorm = keys, ids, qnorm

    def result(self) -> TopK:
        keys = self._keys.float().cpu().numpy()
        ids = self._ids.cpu().numpy()
        missing = ~np.isfinite(keys)
        ids[missing] = -1
        if self._qnorm is None:
            return TopK(ids, np.where(missing, -np.inf, keys).astype(np.float32))
        dist = np.maximum(self._qnorm[:, None] - keys, 0.0)
        return TopK(ids, np.where(missing, np.inf, dist).astype(np.float32))


class GpuTier:
    """Resident IVF lists on ``device`` within ``budget_bytes`` (see module doc).

    Public state: ``clusters`` (resident now, sorted), ``loading`` (in transit), ``num_bytes``
    (device bytes allocated), ``budget_bytes``, ``device``, ``dtype``, ``hit_rate`` (decayed
    share of probes served here). Mutated by ``begin_load``/``evict``/``invalidate``/
    ``poll``/``observe``; ``scan`` only reads. Thread-safe.
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
    ) -> None:
        import torch

        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be 'ip' or 'l2', got {metric!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available (use device='cpu')")
        self._torch = torch
        self.device = str(dev)
        self.dtype = dtype
        self.dim, self.nlist, self.is_l2 = dim, nlist, metric == "l2"
        self.chunk_size = chunk_size
        self.budget_bytes = int(budget_bytes)
        self._tdtype = getattr(torch, dtype)
        elem = torch.empty(0, dtype=self._tdtype).element_size()
        self.chunk_bytes = chunk_size * (dim * elem + 8 + 4)
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
        self._rebuild_lookup()
        self._hits = 0.0
        self._probes = 0.0
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
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
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
        lookup = np.zeros(self.nlist, dtype=bool)
        starts = np.zeros(self.nlist, dtype=np.int64)
        counts = np.zeros(self.nlist, dtype=np.int64)
        table = []
        pos = 0
        for c, chunks in self._resident.items():
            lookup[c] = True
            starts[c], counts[c] = pos, len(chunks)
            table.append(chunks)
            pos += len(chunks)
        self._table = np.concatenate(table) if table else np.zeros(0, np.int64)
        self._starts, self._counts = starts, counts
        self._lookup = lookup  # NOTE: replaced, never mutated: readers may hold the old one

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

    # -- scan -----------------------------------------------------------------------------------

    def scan(
        self, queries: np.ndarray, cluster_ids: np.ndarray, k: int
    ) -> tuple[PendingScan | None, np.ndarray]:
        """Enqueue the scan of every resident list in ``cluster_ids`` (``[n, w]``, ``-1`` pads)
        for ``queries`` (``[n, dim]`` float32). Returns the pending result (``None`` when no
        probe is resident) and the mask of the probes it covers: the caller scans the rest."""
        cids = np.asarray(cluster_ids, dtype=np.int64)
        with self._lock:
            on = self.resident_mask(cids)
            if not on.any():
                return None, on
            pairs = self._pairs(cids, on)
            q = np.ascontiguousarray(queries, np.float32)
            return self._enqueue(q, pairs, int(k)), on

    def _pairs(self, cids: np.ndarray, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, chunk) of every (query, resident chunk) pair, grouped by row."""
        rows, cols = np.nonzero(on)
        clusters = cids[rows, cols]
        cnt = self._counts[clusters]
        offsets = np.repeat(self._starts[clusters] - (np.cumsum(cnt) - cnt), cnt)
        chunks = self._table[offsets + np.arange(int(cnt.sum()))]
        return np.repeat(rows, cnt), chunks

    def _enqueue(self, q: np.ndarray, pairs: tuple[np.ndarray, np.ndarray], k: int) -> PendingScan:
        torch = self._torch
        rows, chunks = pairs
        n = len(q)
        per_row = np.bincount(rows, minlength=n)
        col = np.arange(len(rows)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        width, kk = int(per_row.max()), min(k, self.chunk_size)
        groups, flat = self._plan_groups(rows, chunks, rows * width + col, kk, n * width)
        dev = self._vectors.device
        # NOTE: one upload of every index array before the first kernel, and no boolean
        # masks on the device: nothing here waits for the GPU, so the CPU part of a hybrid
        # scan runs while these kernels do.
        qd = torch.from_numpy(q).to(dev, non_blocking=True).to(self._tdtype)
        qidx, ch, dest = (torch.from_numpy(a).to(dev, non_blocking=True) for a in flat)
        keys = torch.full(((n * width + 1) * kk,), -np.inf, device=dev)  # + one dump block
        ids = torch.full(((n * width + 1) * kk,), -1, dtype=torch.int64, device=dev)
        ar = torch.arange(kk, device=dev)
        scale = 2.0 if self.is_l2 else 1.0
        for g, mpad, qa, ca in groups:
            gq = qidx[qa : qa + g * mpad].view(g, mpad)
            gc = ch[ca : ca + g]
            s = torch.bmm(qd[gq], self._vectors[gc].transpose(1, 2)).float()
            s = s * scale + self._bias[gc][:, None, :]
            vals, pos = s.topk(kk, dim=-1)
            found = self._ids[gc].gather(1, pos.view(g, mpad * kk))
            idx = (dest[qa : qa + g * mpad, None] * kk + ar).view(-1)
            keys[idx] = vals.reshape(-1)
            ids[idx] = found.reshape(-1)
        keys = keys[: n * width * kk].view(n, width * kk)
        ids = ids[: n * width * kk].view(n, width * kk)
        top_keys, top_ids = _canonical_topk(torch, keys, ids, k, self.is_l2)
        qnorm = np.einsum("nd,nd->n", q, q) if self.is_l2 else None
        return PendingScan(top_keys, top_ids, qnorm)

    def _plan_groups(
        self, rows: np.ndarray, chunks: np.ndarray, target: np.ndarray, kk: int, dump: int
    ) -> tuple[list[tuple[int, int, int, int]], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """bmm groups ``(num_chunks, padded queries, offset in qidx/dest, offset in chunks)``
        and the flat arrays: query row per slot, chunk per group entry, candidate block per
        slot (``dump`` for padding slots)."""
        order = np.argsort(chunks, kind="stable")
        uniq, first, m = np.unique(chunks[order], return_index=True, return_counts=True)
        by_m = np.argsort(m, kind="stable")  # chunks probed by similar numbers of queries
        groups, qparts, dparts = [], [], []
        a = qa = 0
        while a < len(by_m):
            b = self._group_end(m, by_m, a)
            sel = by_m[a:b]
            mpad = int(m[sel].max())
            slot = np.arange(mpad)[None, :]
            valid = slot < m[sel][:, None]
            pair = order[np.where(valid, first[sel][:, None] + slot, 0)]
            qparts.append(np.where(valid, rows[pair], 0).ravel())
            dparts.append(np.where(valid, target[pair], dump).ravel())
            groups.append((len(sel), mpad, qa, a))
            qa += len(sel) * mpad
            a = b
        flat = (np.concatenate(qparts), uniq[by_m], np.concatenate(dparts))
        return groups, flat

    def _group_end(self, m: np.ndarray, by_m: np.ndarray, a: int) -> int:
        """End of the bmm group starting at ``by_m[a]`` (groups of ascending query counts)."""
        per_chunk_bytes = self.chunk_size * self.dim * self._vectors.element_size()
        max_g = max(1, MAX_GROUP_BYTES // per_chunk_bytes)
        b = min(len(by_m), a + max_g)
        while b > a + 1 and (b - a) * int(m[by_m[b - 1]]) * self.chunk_size > MAX_GROUP_SCORES:
            b = a + max(1, MAX_GROUP_SCORES // (int(m[by_m[b - 1]]) * self.chunk_size))
        return b


def _canonical_topk(torch: Any, keys: Any, ids: Any, k: int, is_l2: bool) -> tuple[Any, Any]:
    """Per row, the ``k`` best keys (larger = better) with ties by id as Faiss orders them
    (ascending for L2, descending for IP); short rows padded with ``-inf`` / ``-1``."""
    tie = ids if is_l2 else -ids
    by_id = torch.sort(tie, dim=1, stable=True).indices
    k1 = keys.gather(1, by_id)
    take = min(k, keys.shape[1])
    by_key = torch.sort(k1, dim=1, descending=True, stable=True).indices[:, :take]
    final = by_id.gather(1, by_key)
    top_keys, top_ids = keys.gather(1, final), ids.gather(1, final)
    if take < k:
        pad = k - take
        top_keys = torch.nn.functional.pad(top_keys, (0, pad), value=-np.inf)
        top_ids = torch.nn.functional.pad(top_ids, (0, pad), value=-1)
    return top_keys, top_ids


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
