"""Coarse quantizer training (k-means) and assignment in torch for the bulk build on a GPU
(CPU tensors in tests). fp32 with TF32 off, so an assignment differs from Faiss's `IndexFlat`
one only where two centroids tie within rounding. K-means follows Faiss's IVF training in
spirit: a seeded sample as initial centroids, fixed Lloyd iterations, spherical for IP, an
empty cluster takes a random point; sums by one-hot matmul, so a run is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

CHUNK_ROWS = 1 << 16


@contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls without TF32 inside the block."""
    import torch

    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = old


def assign(
    x: np.ndarray, centroids: np.ndarray, metric: str, *, device: str, chunk_rows: int = CHUNK_ROWS
) -> np.ndarray:
    """int64 `[n]`: each host row's nearest centroid, streamed in chunks of `chunk_rows`."""
    import torch

    _check_metric(metric)
    dev = torch.device(device)
    c = torch.as_tensor(np.ascontiguousarray(centroids, dtype=np.float32), device=dev)
    out = np.empty(len(x), dtype=np.int64)
    with exact_fp32(), torch.no_grad():
        c_sq = (c * c).sum(1) if metric == "l2" else None
        for a in range(0, len(x), chunk_rows):
            xb = torch.from_numpy(np.ascontiguousarray(x[a : a + chunk_rows])).to(dev)
            out[a : a + len(xb)] = _nearest(xb, c, c_sq).cpu().numpy()
    return out


def kmeans(
    x: np.ndarray, nlist: int, metric: str, *, device: str, niter: int = 10, seed: int = 0
) -> np.ndarray:
    """float32 `[nlist, d]` centroids of all of `x` (pass a sample); unit-norm for IP."""
    import torch

    _check_metric(metric)
    n = len(x)
    if n < nlist:
        raise ValueError(f"need at least nlist={nlist} training vectors, got {n}")
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    with exact_fp32(), torch.no_grad():
        xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dev)
        c = xs[torch.from_numpy(np.sort(rng.choice(n, nlist, replace=False))).to(dev)].clone()
        if metric == "ip":
            c = _unit_rows(c)
        for _ in range(niter):
            sums = torch.zeros_like(c)
            counts = torch.zeros(nlist, dtype=torch.int64, device=dev)
            c_sq = (c * c).sum(1) if metric == "l2" else None
            for a in range(0, n, CHUNK_ROWS):
                xb = xs[a : a + CHUNK_ROWS]
                labels = _nearest(xb, c, c_sq)
                onehot = torch.zeros(len(xb), nlist, dtype=xs.dtype, device=dev)
                onehot[torch.arange(len(xb), device=dev), labels] = 1.0
                sums += onehot.T @ xb
                counts += torch.bincount(labels, minlength=nlist)
            c = sums / counts.clamp(min=1).to(sums.dtype)[:, None]
            empty = torch.nonzero(counts == 0).flatten().cpu().numpy()
            if len(empty):  # NOTE: Faiss splits a big cluster instead; a random point is simpler
                picks = torch.from_numpy(rng.choice(n, len(empty), replace=False)).to(dev)
                c[torch.from_numpy(empty).to(dev)] = xs[picks]
            if metric == "ip":
                c = _unit_rows(c)
        return c.cpu().numpy()


def _nearest(xb: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor | None) -> torch.Tensor:
    scores = xb @ c.T
    if c_sq is None:
        return scores.argmax(1)
    return (c_sq[None, :] - 2.0 * scores).argmin(1)  # |x|^2 is the same for every centroid


def _unit_rows(c: torch.Tensor) -> torch.Tensor:
    return c / c.norm(dim=1, keepdim=True).clamp(min=1e-30)


def _check_metric(metric: str) -> None:
    if metric not in ("ip", "l2"):
        raise ValueError(f"unknown metric {metric!r}; expected 'ip' or 'l2'")
