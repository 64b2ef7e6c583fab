"""Step-wise IVF search on stock Faiss: assign once, scan probe-list slices, merge top-k.

```
assign(q, nprobe) ──> ProbePlan [n, nprobe] ──columns(0,4)──> scan ─┐
                                            ──columns(4,8)──> scan ─┼─> merge ─> TopK
                                            ──   ...      ──> scan ─┘   (any order)
```

A scan is `search_preassigned` with per-call parameters (the shared index is never mutated),
its batch cut into row ranges over one process-wide pool (bit-identical to one thread). Partial
results merge under Faiss's heap order: score, then id (ascending for L2, descending for IP).
NOTE: a tie across the k-th boundary is resolved by id here, while Faiss keeps whichever its
heap reached first (only with duplicate vectors or PQ codes in one list).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import faiss
import numpy as np

from ragserve.retrieval.types import ProbePlan, TopK

KINDS = ("ivf_flat", "ivf_sq8", "ivf_pq")
SCAN_THREADS_ENV = "RAGSERVE_CPU_SCAN_THREADS"
# NOTE: a thread's share of a scan is at least this many probed rows (~0.5 ms of Faiss's scan on
# one core at 128 dims, any kind), so a handoff to the pool (tens of microseconds) pays for itself.
MIN_SCAN_ROWS_PER_THREAD = 16384
NO_HEAP_INIT = 1024  # NOTE: Faiss's PARALLEL_MODE_NO_HEAP_INIT flag (IndexIVF.h; not exported)
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}


def default_pq_m(dim: int) -> int:
    """Sub-quantizer count: the largest divisor of `dim` leaving at least 4 dims per sub-vector."""
    return max(m for m in range(1, dim + 1) if dim % m == 0 and dim // m >= 4) if dim >= 4 else 1


def make_ivf(
    dim: int,
    nlist: int,
    kind: str = "ivf_flat",
    metric: str = "ip",
    *,
    pq_m: int | None = None,
    pq_nbits: int = 8,
) -> faiss.IndexIVF:
    """An untrained IVF index (`kind` in `KINDS`, `metric` "ip"/"l2") with a flat quantizer."""
    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}; expected one of {KINDS}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected 'ip' or 'l2'")
    if nlist < 1:
        raise ValueError(f"nlist must be >= 1, got {nlist}")
    mt = METRICS[metric]
    quantizer = faiss.IndexFlatIP(dim) if metric == "ip" else faiss.IndexFlatL2(dim)
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, mt)
    elif kind == "ivf_sq8":
        index = faiss.IndexIVFScalarQuantizer(
            quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, mt
        )
    else:
        m = pq_m or default_pq_m(dim)
        if dim % m:
            raise ValueError(f"pq_m={m} does not divide dim={dim}")
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, pq_nbits, mt)
    index.own_fields = True
    quantizer.this.disown()
    return index


def train(
    index: faiss.IndexIVF, vectors: np.ndarray, *, max_train: int | None = None, seed: int = 0
) -> None:
    """Train the coarse quantizer (and SQ/PQ codebooks) on a seeded sample of `vectors`."""
    x = train_sample(np.ascontiguousarray(vectors, dtype=np.float32), max_train, seed)
    if len(x) < index.nlist:
        raise ValueError(f"need at least nlist={index.nlist} training vectors, got {len(x)}")
    pq = getattr(index, "pq", None)
    if pq is not None and len(x) < pq.ksub:
        raise ValueError(
            f"PQ with {pq.nbits} bits needs at least {pq.ksub} training vectors, got {len(x)}; "
            "use fewer bits (pq_nbits) or another kind"
        )
    index.cp.seed = seed
    index.train(x)


def train_sample(x: np.ndarray, max_train: int | None, seed: int) -> np.ndarray:
    """The rows `train` trains on: all of `x`, or a seeded sample of `max_train` in row order."""
    if max_train is None or len(x) <= max_train:
        return x
    pick = np.random.default_rng(seed).choice(len(x), size=max_train, replace=False)
    return x[np.sort(pick)]


def assign(index: faiss.Index, queries: np.ndarray, nprobe: int) -> ProbePlan:
    """Coarse assignment: each query's `nprobe` nearest clusters, best first (`index`: an IVF
    index or its coarse quantizer)."""
    quantizer = getattr(index, "quantizer", index)
    q = check_queries(quantizer, queries)
    nprobe = max(1, min(int(nprobe), quantizer.ntotal))
    dists, ids = quantizer.search(q, nprobe)
    return ProbePlan(ids.astype(np.int64, copy=False), dists.astype(np.float32, copy=False))


def scan(index: faiss.IndexIVF, queries: np.ndarray, plan: ProbePlan, topk: int) -> TopK:
    """Scan the clusters of `plan` (one step) for every query; returns this step's top-k."""
    q = check_queries(index, queries)
    n, k = len(q), int(topk)
    if k < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if plan.cluster_ids.shape[0] != n:
        raise ValueError(f"plan has {plan.cluster_ids.shape[0]} rows for {n} queries")
    width = plan.width
    if width == 0 or n == 0:
        return empty_topk(n, k, index.metric_type == faiss.METRIC_L2)
    iq = np.ascontiguousarray(plan.cluster_ids, dtype=np.int64)
    dq = np.ascontiguousarray(plan.coarse_dists, dtype=np.float32)
    dist = np.empty((n, k), dtype=np.float32)
    ids = np.empty((n, k), dtype=np.int64)
    call = functools.partial(_scan_rows, index, k, _ivf_params(width), (q, iq, dq, dist, ids))
    threads = 1 if index.parallel_mode & ~NO_HEAP_INIT else split_threads(index, n, width)
    if threads <= 1 or threading.current_thread().name.startswith(_POOL_PREFIX):
        call(0, n)
    else:
        bounds = np.linspace(0, n, threads + 1).astype(int).tolist()
        pool = _pool(threads - 1)
        rest = [pool.submit(call, a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
        try:
            call(bounds[0], bounds[1])
        finally:  # NOTE: every range done before the caller lets go of the index (its lock)
            wait(rest)
        for future in rest:
            future.result()
    # NOTE: Faiss's heap already gives the canonical order; only missing slots' fill changes.
    dist[ids < 0] = np.inf if index.metric_type == faiss.METRIC_L2 else -np.inf
    return TopK(ids, dist)


def merge(a: TopK | None, b: TopK, is_l2: bool) -> TopK:
    """Merge two partial results of the same queries and k (scores of disjoint clusters),
    both in the canonical order `scan` gives, keeping it: any split, in any order, equals
    `index.search`."""
    if a is None:
        return b
    k = a.ids.shape[1]
    ids = np.concatenate((a.ids, b.ids), 1)
    scores = np.concatenate((a.scores, b.scores), 1)
    # NOTE: missing slots hold the worst score (+inf for L2, -inf for IP) so they sort last.
    # A stable sort on the score alone keeps each input's own tie order; only rows where an
    # `a` entry and a `b` entry tie exactly (rare) need the id as a second key.
    key = scores if is_l2 else -scores
    order = np.argsort(key, axis=1, kind="stable")[:, : k + 1]
    rows = np.arange(len(key))[:, None]
    top = key[rows, order]
    ties = np.flatnonzero(((top[:, 1:] == top[:, :-1]) & np.isfinite(top[:, 1:])).any(1))
    order = order[:, :k]
    if len(ties):
        tie_ids = ids[ties] if is_l2 else -ids[ties]
        order[ties] = np.lexsort((tie_ids, key[ties]), axis=-1)[:, :k]
    return TopK(ids[rows, order], scores[rows, order])


def search(
    index: faiss.IndexIVF, queries: np.ndarray, topk: int, nprobe: int, num_steps: int = 1
) -> TopK:
    """Assign then scan the probe lists in `num_steps` slices; equals `index.search`."""
    q = check_queries(index, queries)
    plan = assign(index, q, nprobe)
    is_l2 = index.metric_type == faiss.METRIC_L2
    state = None
    for step in plan.split(num_steps):
        state = merge(state, scan(index, q, step, topk), is_l2)
    return state if state is not None else empty_topk(len(q), topk, is_l2)


def empty_topk(n: int, k: int, is_l2: bool) -> TopK:
    fill = np.inf if is_l2 else -np.inf
    return TopK(np.full((n, k), -1, np.int64), np.full((n, k), fill, np.float32))


def exact_topk(
    queries: np.ndarray, row_ids: np.ndarray, x: np.ndarray, topk: int, is_l2: bool = False
) -> TopK:
    """Brute-force top-`topk` of the rows `row_ids` (vectors `x`) per query, ties in row
    order; missing slots: id `-1`, score 0."""
    ids = np.full((len(queries), topk), -1, dtype=np.int64)
    scores = np.zeros((len(queries), topk), dtype=np.float32)
    if len(row_ids):
        q = np.asarray(queries, dtype=np.float32)
        if is_l2:
            s = (q * q).sum(1)[:, None] - 2 * q @ x.T + (x * x).sum(1)[None, :]
        else:
            s = q @ x.T
        order = np.argsort(s if is_l2 else -s, axis=1, kind="stable")[:, :topk]
        ids[:, : order.shape[1]] = row_ids[order]
        scores[:, : order.shape[1]] = np.take_along_axis(s, order, axis=1)
    return TopK(ids, scores)


@functools.lru_cache(maxsize=256)
def _ivf_params(width: int) -> faiss.SearchParametersIVF:
    """Read-only per-call search parameters, shared by concurrent scans of the same width."""
    return faiss.SearchParametersIVF(nprobe=width)


def split_threads(index: faiss.IndexIVF, n: int, width: int) -> int:
    """Threads `scan` gives `n` queries x `width` lists: `scan_threads()`, at most one a query
    and one per `MIN_SCAN_ROWS_PER_THREAD` probed rows (at the mean list size)."""
    rows = n * width * index.ntotal / max(1, index.nlist)
    return max(1, min(n, scan_threads(), int(rows // max(1, MIN_SCAN_ROWS_PER_THREAD))))


def _scan_rows(index: faiss.IndexIVF, k: int, params, arrays: tuple, a: int, b: int) -> None:
    """Faiss's `search_preassigned` of rows `a:b` of `arrays` = (q, iq, dq, dist, ids)."""
    q, iq, dq, dist, ids = (faiss.swig_ptr(x[a:b]) for x in arrays)
    index.search_preassigned_c(b - a, q, k, iq, dq, dist, ids, False, params)


def set_scan_threads(threads: int | None) -> int | None:
    """Set this process's CPU scan threads (None: Faiss's OpenMP thread count, read at each
    scan; initially `RAGSERVE_CPU_SCAN_THREADS` when set); returns the previous setting."""
    global _scan_threads
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"scan threads must be a positive integer or None, got {threads!r}")
    previous, _scan_threads = _scan_threads, threads
    return previous


def scan_threads() -> int:
    """How many threads a `scan` of a large enough batch uses now (see `set_scan_threads`)."""
    return _scan_threads or max(1, int(faiss.omp_get_max_threads()))


def _threads_from_env() -> int | None:
    raw = os.environ.get(SCAN_THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{SCAN_THREADS_ENV} must be a positive integer, got {raw!r}")
    return int(raw)


_POOL_PREFIX = "ragserve-cpu-scan"
_pool_lock = threading.Lock()
_pool_executor: ThreadPoolExecutor | None = None
_pool_workers = 0
_scan_threads: int | None = _threads_from_env()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared scan pool with at least `workers` threads (grown, never shrunk)."""
    global _pool_executor, _pool_workers
    with _pool_lock:
        pool = _pool_executor
        if pool is None or _pool_workers < workers:
            # NOTE: a replaced pool is not shut down: a scan holding it may still submit; its
            # idle threads exit once it is garbage-collected.
            pool = _pool_executor = ThreadPoolExecutor(workers, thread_name_prefix=_POOL_PREFIX)
            _pool_workers = workers
        return pool


def _forget_pool() -> None:
    """In a forked child the parent's pool threads are gone and its lock may be held."""
    global _pool_lock, _pool_executor, _pool_workers
    _pool_lock, _pool_executor, _pool_workers = threading.Lock(), None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def check_queries(index: faiss.Index, queries: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim != 2 or q.shape[1] != index.d:
        raise ValueError(f"queries must have shape [n, {index.d}], got {tuple(q.shape)}")
    return q


def check_vectors(vectors: np.ndarray, num_docs: int) -> np.ndarray:
    """One float32 row per document, C-contiguous (``vectors`` itself when it is already)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if x.ndim != 2 or len(x) != num_docs:
        raise ValueError(f"need one vector per document: {num_docs} docs, {x.shape} vectors")
    return x
