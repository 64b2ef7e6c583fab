"""Coarse assignment on the GPU tier's device, with Faiss's results (issue 10).

The device scores queries against the centroids in float64 (one matmul + ``topk``), each
score within ``bound = bound32 + bound64`` of Faiss's float32 one, which splits a query's
clusters in three::

    device scores, best first:   s[0] ... s[nprobe-1] | s[nprobe] ...
    sure   (certainly probed by Faiss):   s_c - 2 bound >  s[nprobe]
    band   (may or may not be):           neither
    out    (certainly not):               s_c + 2 bound <  s[nprobe-1]

``search`` scans ``sure`` and ``band`` apart: where no band hit beats ``sure``'s k-th
(strictly), every probe set Faiss could choose gives ``sure``'s top-k; other rows (rare) are
searched again with Faiss's assignment. Bounds: ``gamma_d * |q| * max|c|`` (IP),
``gamma_(d+4) * (|q| + max|c|)**2`` (L2), ``gamma_d = d u / (1 - d u)``.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from ragserve.retrieval.types import ProbePlan, TopK

FLOAT32_ROUNDOFF = 2.0**-24
FLOAT64_ROUNDOFF = 2.0**-53
MAX_BAND = 32  # clusters past the nprobe-th looked at for the band; a wider band: Faiss assigns


def gamma(num_terms: int, roundoff: float = FLOAT32_ROUNDOFF) -> float:
    """Higham's ``gamma_n``: the relative error bound of an ``n``-term dot product."""
    nu = num_terms * roundoff
    if nu >= 1.0:
        raise ValueError(f"no error bound for {num_terms} terms at roundoff {roundoff}")
    return nu / (1.0 - nu)


class TierAssignment(NamedTuple):
    """``sure`` ``[n, nprobe]`` (``-1`` at band ranks), the ``band`` of rows ``band_rows``, and
    ``redo``: rows whose band ran past ``MAX_BAND`` (Faiss assigns them)."""

    sure: ProbePlan
    band: ProbePlan
    band_rows: np.ndarray
    redo: np.ndarray


class DeviceAssigner:
    """The centroids on ``device`` in float64: ``assign`` splits a batch's clusters, ``settle``
    names the rows whose scans may differ from Faiss's. Counts ``num_rows``, ``num_band_rows``,
    ``num_fallback_rows``. Thread-safe."""

    def __init__(self, torch: Any, centroids: np.ndarray, is_l2: bool, device: Any) -> None:
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or len(c) == 0:
            raise ValueError(f"centroids must be [nlist, dim], got shape {c.shape}")
        self._torch, self.is_l2 = torch, bool(is_l2)
        self.nlist, self.dim = c.shape
        self._c = torch.from_numpy(c).to(device).double()
        self._c_sq = (self._c * self._c).sum(1)
        self._c_norm_max = float(np.sqrt(np.einsum("nd,nd->n", c, c, dtype=np.float64).max()))
        terms = self.dim + 4 if is_l2 else self.dim
        self._gamma = gamma(terms) + gamma(terms, FLOAT64_ROUNDOFF)
        self._lock = threading.Lock()
        self.num_rows = self.num_band_rows = self.num_fallback_rows = 0

    def assign(self, queries: np.ndarray, nprobe: int) -> TierAssignment:
        torch = self._torch
        q = np.ascontiguousarray(queries, dtype=np.float32)
        nprobe = max(1, min(int(nprobe), self.nlist))
        ip = torch.from_numpy(q).to(self._c.device).double() @ self._c.T
        # NOTE: larger is better on both metrics here; L2 is turned back into a distance below
        scores = 2.0 * ip - self._c_sq if self.is_l2 else ip
        width = min(nprobe + MAX_BAND, self.nlist)
        top, at = scores.topk(width, dim=1)
        top, at = top.cpu().numpy(), at.cpu().numpy()  # the one wait on the device
        dists = top
        if self.is_l2:
            dists = np.einsum("nd,nd->n", q, q, dtype=np.float64)[:, None] - top
        dists = dists.astype(np.float32)
        band = np.zeros_like(top, dtype=bool)
        if width > nprobe:
            margin = 2.0 * self._bounds(q)
            band = (top <= (top[:, nprobe] + margin)[:, None]) & (
                top >= (top[:, nprobe - 1] - margin)[:, None]
            )
        redo = np.flatnonzero(band[:, -1]) if width < self.nlist else np.empty(0, np.int64)
        band[redo] = False
        sure = ProbePlan(np.where(band, -1, at)[:, :nprobe], dists[:, :nprobe])
        rows = np.flatnonzero(band.any(1))
        cols = max(1, int(band.sum(1).max())) if len(rows) else 0
        order = np.argsort(~band[rows], axis=1, kind="stable")[:, :cols]  # band ranks first
        picked = np.take_along_axis(band[rows], order, 1)
        band_ids = np.where(picked, np.take_along_axis(at[rows], order, 1), -1)
        band_plan = ProbePlan(band_ids, np.take_along_axis(dists[rows], order, 1))
        with self._lock:
            self.num_rows += len(q)
            self.num_band_rows += len(rows)
        return TierAssignment(sure, band_plan, rows, redo)

    def settle(self, split: TierAssignment, sure: TopK, band: TopK | None) -> np.ndarray:
        """Rows whose ``sure`` top-k may differ from Faiss's: a band hit ties or beats its k-th
        (``band``: the scan of ``split.band``, or None), and ``split.redo``."""
        unsure = split.redo
        if band is not None:
            kth = sure.scores[split.band_rows, -1]
            best = band.scores[:, 0]
            beaten = (best <= kth) if self.is_l2 else (best >= kth)
            unsure = np.union1d(split.band_rows[beaten], split.redo).astype(np.int64)
        with self._lock:
            self.num_fallback_rows += len(unsure)
        return unsure

    def _bounds(self, q: np.ndarray) -> np.ndarray:
        q_norm = np.sqrt(np.einsum("nd,nd->n", q, q, dtype=np.float64))
        if self.is_l2:
            return self._gamma * (q_norm + self._c_norm_max) ** 2
        return self._gamma * q_norm * self._c_norm_max


ASSIGN_PATHS = ("tier", "faiss")


class AssignChooser:
    """``assign="auto"``: per power-of-two batch-size bucket, the first ``2 * trials`` batches
    alternate ``tier`` / ``faiss`` (timed end to end, the first of each a warm-up), then the
    lower median keeps the bucket. Thread-safe."""

    def __init__(self, trials: int = 3) -> None:
        if trials < 2:
            raise ValueError(f"trials must be >= 2 (one is a warm-up), got {trials}")
        self.trials = trials
        self._lock = threading.Lock()
        self._seconds: dict[int, dict[str, list[float]]] = {}
        self._chosen: dict[int, str] = {}

    @staticmethod
    def bucket(num_queries: int) -> int:
        return 1 << max(0, int(num_queries) - 1).bit_length()

    def choose(self, num_queries: int) -> str:
        b = self.bucket(num_queries)
        with self._lock:
            if b in self._chosen:
                return self._chosen[b]
            runs = self._seconds.setdefault(b, {p: [] for p in ASSIGN_PATHS})
            return min(ASSIGN_PATHS, key=lambda p: len(runs[p]))  # tier first, then alternate

    def record(self, num_queries: int, path: str, seconds: float) -> None:
        if path not in ASSIGN_PATHS:
            raise ValueError(f"path must be one of {ASSIGN_PATHS}, got {path!r}")
        b = self.bucket(num_queries)
        with self._lock:
            if b in self._chosen:
                return
            runs = self._seconds.setdefault(b, {p: [] for p in ASSIGN_PATHS})
            runs[path].append(float(seconds))
            if all(len(runs[p]) >= self.trials for p in ASSIGN_PATHS):
                median = {p: float(np.median(runs[p][1:])) for p in ASSIGN_PATHS}
                self._chosen[b] = min(ASSIGN_PATHS, key=lambda p: median[p])

    @property
    def choices(self) -> dict[int, str]:
        with self._lock:
            return dict(self._chosen)

    @property
    def seconds(self) -> dict[int, dict[str, list[float]]]:
        with self._lock:
            return {b: {p: list(v) for p, v in runs.items()} for b, runs in self._seconds.items()}
