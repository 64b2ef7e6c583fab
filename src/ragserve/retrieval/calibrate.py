"""Default `nprobe` of a new IVF index: every cluster for small indexes (an exhaustive scan
costs little there and loses nothing), otherwise the smallest power of two whose recall@10 on
held-out passage queries reaches `target` of exhaustive search."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import faiss
import numpy as np

# NOTE: up to 20k vectors a full scan costs less than the query's own embedding, so small
# indexes lose no recall to probing (BENCHMARKS.md, "Exhaustive-search threshold").
EXHAUSTIVE_MAX_VECTORS = 20_000
RECALL_TARGET = 0.95
NUM_QUERIES = 256
RECALL_AT = 10


@dataclass(frozen=True)
class NprobeCalibration:
    """How the default nprobe was chosen (manifest metadata)."""

    nprobe: int
    rule: str  # "exhaustive" (small index) or "recall"
    recall: float | None = None  # recall@10 vs exhaustive at `nprobe`
    target: float | None = None
    num_queries: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def calibrate_nprobe(
    index: faiss.IndexIVF,
    x: np.ndarray,
    ids: np.ndarray | None = None,
    *,
    target: float = RECALL_TARGET,
    seed: int = 0,
) -> NprobeCalibration:
    """The default nprobe of `index` holding `x` under `ids` (default 1..n); each query is a
    stored passage without its own id in the results (a held-out passage)."""
    nlist, n = int(index.nlist), len(x)
    if n <= EXHAUSTIVE_MAX_VECTORS or nlist == 1:
        return NprobeCalibration(nlist, "exhaustive")
    ids = np.arange(1, n + 1, dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
    rng = np.random.default_rng(seed)
    rows = rng.choice(n, min(NUM_QUERIES, n), replace=False)
    q, self_ids = np.ascontiguousarray(x[rows]), ids[rows]
    truth = _neighbours(index, q, self_ids, nlist)
    probe = 1
    while True:
        found = _neighbours(index, q, self_ids, probe)
        hits = sum(
            len(np.intersect1d(a[a >= 0], b[b >= 0])) for a, b in zip(found, truth, strict=True)
        )
        recall = hits / max(1, int((truth >= 0).sum()))
        if recall >= target or probe >= nlist:
            return NprobeCalibration(probe, "recall", round(recall, 4), target, len(q))
        probe = min(nlist, probe * 2)


def _neighbours(index: faiss.IndexIVF, q: np.ndarray, self_ids: np.ndarray, nprobe: int):
    params = faiss.SearchParametersIVF(nprobe=nprobe)
    _, found = index.search(q, RECALL_AT + 1, params=params)
    out = np.full((len(q), RECALL_AT), -1, dtype=np.int64)
    for i, (row, own) in enumerate(zip(found, self_ids, strict=True)):
        keep = row[row != own][:RECALL_AT]
        out[i, : len(keep)] = keep
    return out
