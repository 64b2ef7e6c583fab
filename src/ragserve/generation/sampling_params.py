"""Per-request decoding knobs."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# NOTE: below ~1e-37 ``logits / temperature`` overflows float32 (NaN probabilities); under
# 1e-5 sampling is the argmax anyway, so (0, MIN_TEMPERATURE) is rejected, not rounded.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6  # a subnormal top_p is 0 in float32: an empty nucleus
MAX_SEED = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64) without wrapping


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes: ``temperature == 0`` is greedy; a ``seed`` gives the request
    its own generator; ``stop`` strings end it and are cut from ``text`` (not the token ids)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 1)
        temperature = _check_real("temperature", self.temperature)
        if temperature != 0.0 and not temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if not MIN_TOP_P <= _check_real("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        upper = "" if high is None else f", below {high}"
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
