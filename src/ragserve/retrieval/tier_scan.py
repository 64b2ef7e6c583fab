"""The GPU tier's scan strategies over its chunk pool (layout: ``gpu_tier``'s module doc) and
the cost model ``scan="auto"`` picks one with (docs/architecture.md, "Scan strategies"):
``grouped`` (probed chunks gathered, one ``bmm`` per group of similar query counts), ``dense``
(every resident row scored in place, unprobed lists masked), ``fused`` (a Triton kernel,
``tier_kernels``, reading each probed chunk once in place). Each returns per query the
canonical top-k keys (``key = a * q.x + bias``, larger is better) and ids, on the device; the
host computes only counts.

Each strategy's seconds are linear in what it reads, fitted on the tier (``GpuTier.calibrate``)
by non-negative least squares on relative error::

    dense   = d0 + d1 * span_rows + d2 * queries * span_rows
    grouped = g0 + g1 * gathered_rows + g2 * scored_rows
    fused   = f0 + f1 * gathered_rows + f2 * scored_rows      (read in place, no copy)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ragserve.retrieval.types import TopK

MAX_GROUP_SCORES = 1 << 26  # (query, row) scores of one bmm group or dense slab
MAX_GROUP_BYTES = 1 << 29  # vector bytes gathered for one bmm group
MAX_FUSED_SCORES = 1 << 28  # keys the fused scan writes for one slice of the batch (1 GiB)
BUCKET_BOUNDS = 1 << np.arange(31, dtype=np.int64)  # bucket b: (2^(b-1), 2^b] queries per list
NUM_BUCKETS = len(BUCKET_BOUNDS)
FUSED_BLOCK_N = 64  # chunk rows per fused-kernel program
FUSED_BLOCK_D = 32  # vector components per step of its loop
FMA_MAX_QUERIES = 4  # runs of at most this many queries skip tl.dot (no padding to 16)
DOT_MAX_BLOCK_M = 64  # query slots per tl.dot block


class Pool(NamedTuple):
    """One scan's snapshot of the tier's device state: ``counts``/``starts`` (``[nlist + 1]``,
    the last a "not resident" sentinel of count 0) index ``table`` (the resident lists' chunks);
    ``chunk_list`` (``[C]``) is each chunk's list, or ``nlist``; chunks ``[0, span)`` hold
    every resident one."""

    vectors: Any  # [C, S, dim]
    ids: Any  # [C, S] int64
    bias: Any  # [C, S] float32
    counts: Any
    starts: Any
    table: Any
    chunk_list: Any
    bounds: Any  # BUCKET_BOUNDS on the device
    nlist: int
    span: int
    is_l2: bool


class GroupedPlan(NamedTuple):
    """Host-side shapes of one grouped scan (see ``plan_grouped``)."""

    num_pairs: int  # (query, resident chunk) pairs
    width: int  # most pairs of one query
    runs: np.ndarray  # [NUM_BUCKETS] distinct chunks per bucket
    mpad: np.ndarray  # [NUM_BUCKETS] most queries of one list in the bucket
    run_offsets: np.ndarray  # [NUM_BUCKETS] first run (distinct chunk) of each bucket
    slot_offsets: np.ndarray  # [NUM_BUCKETS] first query slot of each bucket

    @property
    def num_runs(self) -> int:
        return int(self.runs.sum())

    @property
    def num_slots(self) -> int:
        return int((self.runs * self.mpad).sum())


def plan_grouped(lc: np.ndarray, counts: np.ndarray) -> GroupedPlan:
    """Shapes of the grouped scan of ``lc`` (``[n, w]``, ``nlist`` = not resident) from the
    chunks per list ``counts`` (``[nlist + 1]``): counts only, no sort."""
    nlist = len(counts) - 1
    per_row = counts[lc].sum(1)
    m = np.bincount(lc.ravel(), minlength=nlist + 1)[:nlist]
    live = np.flatnonzero(m * counts[:nlist])
    bucket = np.searchsorted(BUCKET_BOUNDS, m[live])
    runs = np.bincount(bucket, weights=counts[live], minlength=NUM_BUCKETS).astype(np.int64)
    mpad = np.zeros(NUM_BUCKETS, np.int64)
    np.maximum.at(mpad, bucket, m[live])
    slots = runs * mpad
    width = int(per_row.max()) if len(per_row) else 0
    offsets = np.cumsum(runs) - runs, np.cumsum(slots) - slots
    return GroupedPlan(int(per_row.sum()), width, runs, mpad, *offsets)


def grouped_scan(torch: Any, pool: Pool, qd: Any, lc: Any, plan: GroupedPlan, k: int):
    """Top-k keys and ids ``[n, k]`` of the probes ``lc`` (device ``[n, w]``) for ``qd``."""
    n = lc.shape[0]
    dev, size = qd.device, pool.vectors.shape[1]
    width, kk = plan.width, min(k, size)
    dump = n * width  # candidate block of padding slots
    qslot, dslot, run_chunk, _ = _slots(torch, pool, lc, plan, dump)
    keys = torch.full(((dump + 1) * kk,), -np.inf, device=dev)
    ids = torch.full(((dump + 1) * kk,), -1, dtype=torch.int64, device=dev)
    ar = torch.arange(kk, device=dev)
    for g, mp, qa, ra in _groups(plan, pool, size):
        gq = qslot[qa : qa + g * mp].view(g, mp)
        gc = run_chunk[ra : ra + g]
        s = _score(torch, pool, torch.bmm(qd[gq], pool.vectors[gc].transpose(1, 2)))
        s += pool.bias[gc][:, None, :]
        vals, at = s.topk(kk, dim=-1)
        found = pool.ids[gc].gather(1, at.view(g, mp * kk))
        idx = (dslot[qa : qa + g * mp, None] * kk + ar).view(-1)
        keys[idx] = vals.reshape(-1)
        ids[idx] = found.reshape(-1)
    keys = keys[: dump * kk].view(n, width * kk)
    ids = ids[: dump * kk].view(n, width * kk)
    return canonical_topk(torch, keys, ids, k, pool.is_l2)


def _slots(
    torch: Any, pool: Pool, lc: Any, plan: GroupedPlan, dump: int
) -> tuple[Any, Any, Any, Any]:
    """The grouped scan's index arrays, built on the device::

        runs (distinct chunks) sorted by (bucket, chunk)   run r of bucket b:
        slots of bucket b: [run][query 0 .. mpad_b)         slot_offsets[b] + r * mpad_b + rank

    ``qslot``: query row per slot (padding: row 0); ``dslot``: candidate block per slot
    (padding: ``dump``); ``run_chunk``: chunk per run; ``dest_chunk``: chunk per candidate
    block (``[dump]``; blocks no pair fills: chunk 0)."""
    n, w = lc.shape
    dev, num_chunks = lc.device, pool.vectors.shape[0]
    pair, chunk, dest = _pairs(torch, pool, lc, plan.num_pairs, plan.width)
    m = torch.zeros(pool.nlist + 1, dtype=torch.int64, device=dev)  # queries per list
    m.scatter_add_(0, lc.reshape(-1), torch.ones(n * w, dtype=torch.int64, device=dev))
    bucket = torch.searchsorted(pool.bounds, m[lc.reshape(-1)[pair]])
    key = bucket * num_chunks + chunk
    order = torch.sort(key, stable=True).indices
    key = key[order]
    first = torch.ones(plan.num_pairs, dtype=torch.bool, device=dev)
    first[1:] = key[1:] != key[:-1]
    run = torch.cumsum(first, 0) - 1
    pos = torch.arange(plan.num_pairs, device=dev)
    rank = pos - torch.cummax(torch.where(first, pos, 0), 0).values
    tables = np.stack([plan.run_offsets, plan.slot_offsets, plan.mpad])
    run_offsets, slot_offsets, mpad = upload(torch, tables, dev)
    b = bucket[order]
    slot = slot_offsets[b] + (run - run_offsets[b]) * mpad[b] + rank
    qslot = torch.zeros(plan.num_slots, dtype=torch.int64, device=dev)
    dslot = torch.full((plan.num_slots,), dump, dtype=torch.int64, device=dev)
    qslot[slot] = pair[order] // w
    dslot[slot] = dest[order]
    run_chunk = torch.zeros(plan.num_runs, dtype=torch.int64, device=dev)
    run_chunk[run] = chunk[order]
    dest_chunk = torch.zeros(dump, dtype=torch.int64, device=dev)
    dest_chunk[dest] = chunk
    return qslot, dslot, run_chunk, dest_chunk


def _pairs(torch: Any, pool: Pool, lc: Any, num_pairs: int, width: int) -> tuple[Any, Any, Any]:
    """Every (query, resident chunk) pair: its probe (flat index into ``lc``), its chunk, and
    its candidate block ``row * width + column`` (pairs numbered per row in probe order)."""
    n, w = lc.shape
    dev = lc.device
    cnt = pool.counts[lc].reshape(-1)
    flat = torch.arange(n * w, device=dev)
    pair = torch.repeat_interleave(flat, cnt, output_size=num_pairs)
    pos = torch.arange(num_pairs, device=dev)
    within = pos - (torch.cumsum(cnt, 0) - cnt)[pair]
    chunk = pool.table[pool.starts[lc.reshape(-1)[pair]] + within]
    per_row = cnt.view(n, w).sum(1)
    row = pair // w
    dest = row * width + pos - (torch.cumsum(per_row, 0) - per_row)[row]
    return pair, chunk, dest


def fused_scan(torch: Any, pool: Pool, qd: Any, lc: Any, plan: GroupedPlan, k: int):
    """``grouped_scan``'s result: the grouped layout, each run's chunk read in place by
    ``tier_kernels.chunk_scan_kernel`` (a launch per bucket), then top-k per slot and merge."""
    n = lc.shape[0]
    dev, (_, size, _) = qd.device, pool.vectors.shape
    width, kk = plan.width, min(k, size)
    dump = n * width
    qslot, dslot, run_chunk, dest_chunk = _slots(torch, pool, lc, plan, dump)
    out = torch.full((dump, size), -np.inf, device=dev)
    for b in np.flatnonzero(plan.runs):
        mp, runs, offsets = int(plan.mpad[b]), int(plan.runs[b]), plan.run_offsets[b]
        block = fused_block_m(mp)
        grid = (runs, -(-size // FUSED_BLOCK_N), -(-mp // block[0]))
        args = (qslot, dslot, run_chunk, out, int(offsets), int(plan.slot_offsets[b]), mp, dump)
        _launch(torch, pool, grid, block, qd, *args, 2.0 if pool.is_l2 else 1.0)
    vals, at = out.topk(kk, dim=1)
    ids = pool.ids.view(-1)[dest_chunk[:, None] * size + at]
    return canonical_topk(torch, vals.view(n, width * kk), ids.view(n, width * kk), k, pool.is_l2)


def fused_warm_up(torch: Any, pool: Pool) -> None:
    """Compile every variant of the fused kernel for this pool (``fused_block_m``'s) with
    launches that store nothing, so that no scan waits for Triton."""
    dev, (_, size, dim) = pool.vectors.device, pool.vectors.shape
    qd = torch.zeros((1, dim), dtype=pool.vectors.dtype, device=dev)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.empty((1, size), device=dev)
    for block in sorted({fused_block_m(m) for m in range(1, 2 * DOT_MAX_BLOCK_M + 1)}):
        _launch(torch, pool, (1, 1, 1), block, qd, zero, zero, zero, out, 0, 0, 1, 0, 1.0)


def _launch(torch: Any, pool: Pool, grid: tuple, block: tuple, qd: Any, *args: Any) -> None:
    block_m, use_dot, num_warps = block
    precision = "ieee" if pool.vectors.dtype == torch.float32 else "tf32"  # NOTE: fp32 only
    fused_kernel(qd.device)[grid](
        qd, pool.vectors, pool.bias, *args,
        DIM=pool.vectors.shape[2], S=pool.vectors.shape[1], BLOCK_M=block_m,
        BLOCK_N=FUSED_BLOCK_N, BLOCK_D=FUSED_BLOCK_D, USE_DOT=use_dot,
        DOT_PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip


def fused_block_m(num_queries: int) -> tuple[int, bool, int]:
    """The fused kernel's query block for runs of ``num_queries`` slots, whether it uses
    ``tl.dot``, and its warps: runs of at most ``FMA_MAX_QUERIES`` take the FMA path at their
    own (power of two) size, larger ones ``tl.dot`` blocks of 16 to ``DOT_MAX_BLOCK_M`` slots.
    NOTE: 8 warps from 4 query rows up keep every variant at <= 158 registers and unspilled
    on sm_90 (ptxas -v; 4 warps: 128-255 with spills), so more programs share an SM."""
    pow2 = 1 << max(0, int(num_queries) - 1).bit_length()
    if num_queries <= FMA_MAX_QUERIES:
        return pow2, False, 8 if pow2 >= 4 else 4
    return min(DOT_MAX_BLOCK_M, max(16, pow2)), True, 8


def fused_slices(lc: np.ndarray, counts: np.ndarray, plan: GroupedPlan, size: int):
    """``(first row, end row, plan)`` of the slices of ``lc`` the fused scan runs apart, so
    that none writes more than ``MAX_FUSED_SCORES`` keys."""
    n = len(lc)
    rows = max(1, MAX_FUSED_SCORES // max(1, plan.width * size))
    if rows >= n:
        return [(0, n, plan)]
    starts = range(0, n, rows)
    return [(a, min(n, a + rows), plan_grouped(lc[a : a + rows], counts)) for a in starts]


def fused_available(device: Any) -> bool:
    """Triton and a CUDA device, or Triton's interpreter (``TRITON_INTERPRET=1``) on CPU."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    if torch.device(device).type == "cuda":
        return True
    import triton

    return bool(triton.knobs.runtime.interpret)


def fused_kernel(device: Any) -> Any:
    if not fused_available(device):
        raise ValueError(
            "scan='fused' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)"
        )
    from ragserve.retrieval.tier_kernels import chunk_scan_kernel

    return chunk_scan_kernel


def _groups(plan: GroupedPlan, pool: Pool, size: int):
    """``(chunks, padded queries, first slot, first run)`` of each bmm group: a bucket's runs,
    cut to ``MAX_GROUP_*``."""
    per_chunk_bytes = size * pool.vectors.shape[2] * pool.vectors.element_size()
    max_g = max(1, MAX_GROUP_BYTES // per_chunk_bytes)
    for b in np.flatnonzero(plan.runs):
        mp, runs = int(plan.mpad[b]), int(plan.runs[b])
        step = max(1, min(max_g, MAX_GROUP_SCORES // (mp * size)))
        for r in range(0, runs, step):
            g = min(step, runs - r)
            yield g, mp, int(plan.slot_offsets[b]) + r * mp, int(plan.run_offsets[b]) + r


def dense_scan(torch: Any, pool: Pool, qd: Any, lc: Any, k: int):
    """``grouped_scan``'s result: every row of the span scored in place, unprobed masked."""
    n = qd.shape[0]
    dev, (_, size, dim) = qd.device, pool.vectors.shape
    probed = torch.zeros((n, pool.nlist + 1), dtype=torch.bool, device=dev)
    probed.scatter_(1, lc, True)
    probed[:, pool.nlist] = False
    step = max(1, MAX_GROUP_SCORES // (n * size))
    part_keys, part_ids = [], []
    for a in range(0, pool.span, step):
        b = min(pool.span, a + step)
        s = _score(torch, pool, qd @ pool.vectors[a:b].view(-1, dim).T)
        s += pool.bias[a:b].view(1, -1)
        keep = probed[:, pool.chunk_list[a:b]]
        s.view(n, b - a, size).masked_fill_(~keep[:, :, None], -np.inf)
        vals, at = s.topk(min(k, s.shape[1]), dim=1)
        part_keys.append(vals)
        part_ids.append(pool.ids[a:b].reshape(-1)[at])
    keys = torch.cat(part_keys, 1) if part_keys else torch.full((n, 0), -np.inf, device=dev)
    ids = torch.cat(part_ids, 1) if part_ids else torch.full((n, 0), -1, device=dev)
    return canonical_topk(torch, keys, ids.to(torch.int64), k, pool.is_l2)


def _score(torch: Any, pool: Pool, products: Any) -> Any:
    """float32 keys' first term: ``q.x`` (IP) or ``2 q.x`` (L2)."""
    s = products.float()
    return s.mul_(2.0) if pool.is_l2 else s


def upload(torch: Any, array: np.ndarray, device: Any) -> Any:
    """``array`` on ``device`` without waiting (pinned staging on CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if host.device.type == "cpu" and torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def canonical_topk(torch: Any, keys: Any, ids: Any, k: int, is_l2: bool) -> tuple[Any, Any]:
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


class PendingScan:
    """Enqueued kernels; ``result()`` waits (on ``done`` when on another stream) for the TopK."""

    def __init__(self, keys: Any, ids: Any, qnorm: np.ndarray | None, done: Any = None) -> None:
        self._keys, self._ids, self._qnorm, self._done = keys, ids, qnorm, done

    def result(self) -> TopK:
        if self._done is not None:
            self._done.synchronize()
        keys = self._keys.float().cpu().numpy()
        ids = self._ids.cpu().numpy()
        missing = ~np.isfinite(keys)
        ids[missing] = -1
        if self._qnorm is None:
            return TopK(ids, np.where(missing, -np.inf, keys).astype(np.float32))
        dist = np.maximum(self._qnorm[:, None] - keys, 0.0)
        return TopK(ids, np.where(missing, np.inf, dist).astype(np.float32))


STRATEGIES = ("grouped", "dense", "fused")
REQUIRED = ("grouped", "dense")  # every fitted model has these; fused where it was timed


class ScanFeatures(NamedTuple):
    """What one batch's scan would read (module doc)."""

    num_queries: int
    span_rows: int
    gathered_rows: int
    scored_rows: int

    def terms(self, strategy: str) -> np.ndarray:
        if strategy == "dense":
            return np.array([1.0, self.span_rows, self.num_queries * self.span_rows])
        if strategy in ("grouped", "fused"):
            return np.array([1.0, self.gathered_rows, self.scored_rows])
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


class ScanSample(NamedTuple):
    """A batch's features and the seconds of the strategies timed on it."""

    features: ScanFeatures
    seconds: dict[str, float]


@dataclass(frozen=True)
class ScanCostModel:
    """Each strategy's seconds per term of ``ScanFeatures.terms`` (fused None: not timed)."""

    dense: tuple[float, float, float]
    grouped: tuple[float, float, float]
    setting: tuple = ()  # what it was measured on (``GpuTier.model_setting``)
    span_rows: int = 0  # the calibrated tier's span
    fused: tuple[float, float, float] | None = None  # None: not timed (no Triton or no CUDA)

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(s for s in STRATEGIES if getattr(self, s) is not None)

    def fits(self, setting: tuple, span_rows: int) -> bool:
        """Same device, dtype and shapes, and a span within 2x of the calibrated one."""
        return setting == self.setting and self.span_rows <= 2 * span_rows <= 4 * self.span_rows

    def predict(self, strategy: str, features: ScanFeatures) -> float:
        if strategy not in self.strategies:
            raise ValueError(f"strategy must be one of {self.strategies}, got {strategy!r}")
        return float(np.dot(getattr(self, strategy), features.terms(strategy)))

    def choose(self, features: ScanFeatures) -> str:
        """The strategy predicted fastest (on a tie the first of grouped, dense, fused)."""
        seconds = [self.predict(s, features) for s in self.strategies]
        return self.strategies[int(np.argmin(seconds))]

    @classmethod
    def fit(
        cls, samples: Sequence[ScanSample], setting: tuple = (), span_rows: int = 0
    ) -> ScanCostModel:
        """NNLS on relative error (3 samples each of grouped and dense; fused if timed 3 times)."""
        coef = {}
        for strategy in STRATEGIES:
            timed = [s for s in samples if strategy in s.seconds]
            if strategy not in REQUIRED and len(timed) < 3:
                continue
            if len(timed) < 3:
                raise ValueError(f"samples: 3 of {strategy} are needed to fit, got {len(timed)}")
            a = np.stack([s.features.terms(strategy) for s in timed])
            t = np.array([s.seconds[strategy] for s in timed], dtype=np.float64)
            if not np.all(np.isfinite(t)) or np.any(t <= 0):
                raise ValueError(f"samples: {strategy} seconds must be positive, got {t}")
            coef[strategy] = tuple(float(c) for c in nnls_relative(a, t))
        return cls(coef["dense"], coef["grouped"], setting, span_rows, coef.get("fused"))


def nnls_relative(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``sum(((a @ x - t) / t) ** 2)``: the best non-negative fit over
    every subset of the columns."""
    w = a / t[:, None]
    scale = np.maximum(np.abs(w).max(0), 1e-300)  # columns differ by orders of magnitude
    w = w / scale
    ones = np.ones(len(t))
    best, best_err = np.zeros(a.shape[1]), float(len(t))  # x = 0: every relative error is 1
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(w[:, cols], ones, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((w[:, cols] @ x - ones) ** 2))
            if err < best_err:
                best = np.zeros(a.shape[1])
                best[list(cols)] = x
                best_err = err
    return best / scale
