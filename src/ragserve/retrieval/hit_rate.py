"""Per-query GPU-tier hit rates as a Beta distribution (VectorLiteRAG §V-B) and a batch's tail
hit rate in one of ``TAIL_MODES`` (docs/tier_policy.md). Pure NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_GRID = 0.5 - 0.5 * np.cos(np.linspace(0.0, math.pi, 4097))  # NOTE: dense near 0 and 1


@dataclass(frozen=True)
class BetaHitRate:
    """Beta of per-query hit rates (``variance == 0``: a point mass at ``mean``)."""

    mean: float
    variance: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.mean <= 1.0:
            raise ValueError(f"mean must be in [0, 1], got {self.mean}")
        limit = self.mean * (1.0 - self.mean)
        if self.variance < 0 or (self.variance > 0 and self.variance >= limit):
            raise ValueError(
                f"variance must be 0 or in (0, mean(1-mean) = {limit}), got {self.variance}"
            )

    @classmethod
    def from_mean(cls, mean: float, max_variance: float) -> BetaHitRate:
        """§V-B: ``sigma^2 = 4 sigma_max^2 mean (1 - mean)``."""
        if not 0.0 <= max_variance < 0.25:
            raise ValueError(f"max_variance must be in [0, 0.25), got {max_variance}")
        return cls(mean, 4.0 * max_variance * mean * (1.0 - mean))

    @property
    def is_point_mass(self) -> bool:
        return self.variance == 0.0

    @property
    def alpha(self) -> float | None:
        return None if self.is_point_mass else self.mean * self._concentration()

    @property
    def beta(self) -> float | None:
        return None if self.is_point_mass else (1.0 - self.mean) * self._concentration()

    def _concentration(self) -> float:
        return self.mean * (1.0 - self.mean) / self.variance - 1.0

    def cdf(self, x: np.ndarray) -> np.ndarray:
        xs = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
        if self.is_point_mass:
            return (xs >= self.mean).astype(np.float64)
        return _betainc(self.alpha, self.beta, xs)

    def expected_min(self, batch_size: int) -> float:
        """Eq. 2: the expected minimum hit rate of ``batch_size`` queries."""
        return float(self.expected_mins(np.asarray([batch_size]))[0])

    def expected_mins(self, batch_sizes: np.ndarray) -> np.ndarray:
        """Eq. 2 by quadrature of ``(1 - F)^B`` (absolute error below 1e-4)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        if b.size and b.min() < 1:
            raise ValueError(f"batch sizes must be >= 1, got min {b.min()}")
        if self.is_point_mass:
            return np.full(b.shape, self.mean)
        survival = np.clip(1.0 - self.cdf(_GRID), 0.0, 1.0)
        with np.errstate(divide="ignore"):
            log_s = np.log(survival)
        dx = np.diff(_GRID)
        out = np.empty(b.size)
        flat = b.ravel()
        for start in range(0, flat.size, 256):
            powered = np.exp(flat[start : start + 256, None] * log_s[None, :])
            out[start : start + 256] = ((powered[:, 1:] + powered[:, :-1]) * 0.5 * dx).sum(1)
        return np.clip(out.reshape(b.shape), 0.0, 1.0)

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (absolute error below 1e-3)."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"q must be in (0, 1), got {q}")
        if self.is_point_mass:
            return self.mean
        return float(_quantiles(np.array([self.alpha]), np.array([self.beta]), q)[0])

    def batch_mean(self, batch_size: int) -> BetaHitRate:
        """The mean of ``batch_size`` draws, moment matched: variance ``/ batch_size``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return BetaHitRate(self.mean, self.variance / batch_size)

    def tail(self, batch_size: int, mode: str = "batch_mean", quantile: float = 0.1) -> float:
        return float(self.tails(np.asarray([batch_size]), mode, quantile)[0])

    def tails(
        self, batch_sizes: np.ndarray, mode: str = "batch_mean", quantile: float = 0.1
    ) -> np.ndarray:
        check_tail_mode(mode, quantile)
        if mode == "min":
            return self.expected_mins(batch_sizes)
        b = np.asarray(batch_sizes, dtype=np.int64)
        if b.size and b.min() < 1:
            raise ValueError(f"batch sizes must be >= 1, got min {b.min()}")
        if self.is_point_mass:
            return np.full(b.shape, self.mean)
        uniq, inverse = np.unique(b, return_inverse=True)
        pooled = [self.batch_mean(int(n)) for n in uniq]  # one Beta per batch size, solved at once
        vals = _quantiles(
            np.array([d.alpha for d in pooled]), np.array([d.beta for d in pooled]), quantile
        )
        return vals[inverse].reshape(b.shape)


TAIL_MODES: tuple[str, ...] = ("batch_mean", "min")


def check_tail_mode(mode: str, quantile: float) -> None:
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode must be one of {TAIL_MODES}, got {mode!r}")
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"tail quantile must be in (0, 1), got {quantile}")


def _quantiles(a: np.ndarray, b: np.ndarray, q: float) -> np.ndarray:
    """``q``-quantiles of Beta(``a``, ``b``): three nested 64-step brackets, then linear."""
    lo, hi = np.zeros(len(a)), np.ones(len(a))
    steps = np.linspace(0.0, 1.0, 65)
    rows = np.arange(len(a))
    for _ in range(3):
        xs = lo[:, None] + (hi - lo)[:, None] * steps[None, :]
        cdf = np.maximum.accumulate(_betainc(a[:, None], b[:, None], xs), axis=1)
        i = np.clip((cdf < q).sum(axis=1), 1, 64)
        lo, hi = xs[rows, i - 1], xs[rows, i]
        c_lo, c_hi = cdf[rows, i - 1], cdf[rows, i]
    width = np.where(c_hi > c_lo, c_hi - c_lo, 1.0)
    return lo + (hi - lo) * np.clip((q - c_lo) / width, 0.0, 1.0) * (c_hi > c_lo)


_LGAMMA = np.frompyfunc(math.lgamma, 1, 1)


def _betainc(a, b, x: np.ndarray) -> np.ndarray:
    """``I_x(a, b)`` by its continued fraction (modified Lentz), flipped to
    ``1 - I_{1-x}(b, a)`` where that converges faster."""
    a, b, x = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (a, b, x)))
    out = np.where(x >= 1.0, 1.0, 0.0)
    inner = (x > 0.0) & (x < 1.0)
    ai, bi, xi = a[inner], b[inner], x[inner]
    log_norm = (_LGAMMA(ai + bi) - _LGAMMA(ai) - _LGAMMA(bi)).astype(np.float64)
    flip = xi >= (ai + 1.0) / (ai + bi + 2.0)
    a2, b2, x2 = np.where(flip, bi, ai), np.where(flip, ai, bi), np.where(flip, 1.0 - xi, xi)
    front = np.exp(log_norm + a2 * np.log(x2) + b2 * np.log1p(-x2))
    res = front * _beta_fraction(a2, b2, x2) / a2
    out[inner] = np.clip(np.where(flip, 1.0 - res, res), 0.0, 1.0)
    return out


def _beta_fraction(a, b, x: np.ndarray, max_iter: int = 10_000) -> np.ndarray:
    tiny, eps = 1e-300, 1e-14
    qab, qap, qam = a + b, a + 1.0, a - 1.0

    def _nz(v: np.ndarray) -> np.ndarray:
        return np.where(np.abs(v) < tiny, tiny, v)

    c = np.ones_like(x)
    d = 1.0 / _nz(1.0 - qab * x / qap)
    h = d.copy()
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 / _nz(1.0 + aa * d)
        c = _nz(1.0 + aa / c)
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 / _nz(1.0 + aa * d)
        c = _nz(1.0 + aa / c)
        delta = d * c
        h *= delta
        if np.all(np.abs(delta - 1.0) < eps):
            break
    return h
