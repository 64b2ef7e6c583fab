"""Coarse assignment on the GPU tier's device, with Faiss's probe sets (issue 10).

``index.search`` with the whole index resident spent about as long in Faiss's CPU quantizer
(``[n, nlist]`` inner products, then an ``nprobe`` heap per query) as in the tier's scan. The
tier keeps the centroids on its device and scores a batch with one matmul + ``topk``.

Faiss's float32 BLAS rounds its scores, so a score computed anywhere else can disagree with it
on which cluster is ``nprobe``-th when two coarse scores nearly tie. For IVF-Flat only the probe
*set* matters (the scanners ignore the order and the coarse distances), so a row is kept when its
set is certain::

    scores (this device, sorted)  s[0] >= ... >= s[nprobe-1]  |  s[nprobe] >= ...
                                               gap = s[nprobe-1] - s[nprobe]
    kept  when gap > 2 * (bound32 + bound64)
    else  the row is assigned again by Faiss (rare; counted in ``num_fallback_rows``)

The device scores in float64 (float32 inputs, so every product is exact; TF32 settings do not
apply), so its scores are within ``bound64`` of the exact ones and Faiss's within ``bound32``:
then Faiss's ``nprobe``-th best still beats every cluster outside the set, and the sets are
equal. The bounds are the textbook dot-product bound ``gamma_d * |q| * max|c|`` (``gamma_d =
d u / (1 - d u)``, ``u = 2**-24`` or ``2**-53``); for L2 (norms, the cross term, two additions)
``gamma_(d+4) * (|q| + max|c|)**2``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ragserve.retrieval.types import ProbePlan

FLOAT32_ROUNDOFF = 2.0**-24
FLOAT64_ROUNDOFF = 2.0**-53


def gamma(num_terms: int, roundoff: float = FLOAT32_ROUNDOFF) -> float:
    """Higham's ``gamma_n``: the relative error bound of an ``n``-term sum of products."""
    nu = num_terms * roundoff
    if nu >= 1.0:
        raise ValueError(f"no error bound for {num_terms} terms at roundoff {roundoff}")
    return nu / (1.0 - nu)


class DeviceAssigner:
    """The coarse quantizer's centroids ``[nlist, dim]`` on a torch ``device`` (float64).

    ``assign(q, nprobe, fallback)`` returns a ``ProbePlan`` whose every row probes the same
    cluster set as Faiss's quantizer (best first by this device's scores, which are the plan's
    ``coarse_dists``: exact for IVF-Flat, whose scanners read neither); rows it cannot certify go
    to ``fallback`` (Faiss). Counts ``num_rows`` and ``num_fallback_rows``. Thread-safe.
    """

    def __init__(self, torch: Any, centroids: np.ndarray, is_l2: bool, device: Any) -> None:
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or len(c) == 0:
            raise ValueError(f"centroids must be [nlist, dim], got shape {c.shape}")
        self._torch, self.is_l2 = torch, bool(is_l2)
        self.nlist, self.dim = c.shape
        self._c = torch.from_numpy(c).to(device).double()
        self._c_sq = (self._c * self._c).sum(1)
        c_norm = float(np.sqrt(np.einsum("nd,nd->n", c, c, dtype=np.float64).max()))
        self._c_norm_max = c_norm
        terms = self.dim + 4 if is_l2 else self.dim
        self._gamma = gamma(terms) + gamma(terms, FLOAT64_ROUNDOFF)
        self._lock = threading.Lock()
        self.num_rows = 0
        self.num_fallback_rows = 0

    def assign(
        self, queries: np.ndarray, nprobe: int, fallback: Callable[[np.ndarray], ProbePlan]
    ) -> ProbePlan:
        """Each query's ``nprobe`` (clamped to ``[1, nlist]``) clusters; ``fallback(rows)`` is
        Faiss's plan of ``queries[rows]``, called only for uncertain rows."""
        torch = self._torch
        q = np.ascontiguousarray(queries, dtype=np.float32)
        n, nprobe = len(q), max(1, min(int(nprobe), self.nlist))
        qd = torch.from_numpy(q).to(self._c.device).double()
        ip = qd @ self._c.T
        # NOTE: larger is better on both metrics here; L2 is turned back into a distance below
        scores = 2.0 * ip - self._c_sq if self.is_l2 else ip
        width = min(nprobe + 1, self.nlist)
        top, at = scores.topk(width, dim=1)
        top, at = top.cpu().numpy(), at.cpu().numpy()  # the one wait on the device
        ids = at[:, :nprobe].astype(np.int64)
        dists = top[:, :nprobe]
        if self.is_l2:
            dists = np.einsum("nd,nd->n", q, q, dtype=np.float64)[:, None] - dists
        dists = dists.astype(np.float32)
        unsure = np.empty(0, dtype=np.int64)
        if width > nprobe:
            unsure = np.flatnonzero(top[:, nprobe - 1] - top[:, nprobe] <= 2.0 * self._bounds(q))
        if len(unsure):
            redo = fallback(unsure)
            ids[unsure], dists[unsure] = redo.cluster_ids, redo.coarse_dists
        with self._lock:
            self.num_rows += n
            self.num_fallback_rows += len(unsure)
        return ProbePlan(ids, dists)

    def _bounds(self, q: np.ndarray) -> np.ndarray:
        """Per query: bound32 + bound64 (module doc) of any one of its coarse scores."""
        q_norm = np.sqrt(np.einsum("nd,nd->n", q, q, dtype=np.float64))
        if self.is_l2:
            return self._gamma * (q_norm + self._c_norm_max) ** 2
        return self._gamma * q_norm * self._c_norm_max
