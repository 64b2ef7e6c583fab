"""Range checks of the per-request knobs (the engine's ranges, ``SamplingParams``), shared by
graph nodes, the scheduler's messages and the HTTP front. Each raises ``ValueError`` naming the
field; booleans are not numbers here."""

from __future__ import annotations

import math
import numbers
from typing import Any

# NOTE: below ~1e-37 ``logits / temperature`` overflows float32 and the softmax is NaN; any
# temperature under 1e-5 samples the argmax anyway (vLLM's greedy epsilon), so the gap
# (0, 1e-5) is rejected rather than silently rounded.
MIN_TEMPERATURE = 1e-5
# NOTE: a subnormal top_p becomes 0 in float32 and the nucleus would be empty.
MIN_TOP_P = 1e-6
MAX_SEED = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64)


def check_int(name: str, value: Any, *, low: int = 1, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        upper = "" if high is None else f", below {high}"
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


def check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value}")
    return number


def check_sampling(
    *, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any = None, seed: Any = None
) -> None:
    check_int("max_tokens", max_tokens)
    temp = check_float("temperature", temperature)
    if temp != 0.0 and temp < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature}"
        )
    p = check_float("top_p", top_p)
    if not MIN_TOP_P <= p <= 1.0:
        raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {top_p}")
    if top_k is not None:
        check_int("top_k", top_k)
    if seed is not None:
        check_int("seed", seed, low=0, high=MAX_SEED)


def check_sampling_of(params: Any) -> None:
    """``check_sampling`` of an object's attributes of those names (a missing one is None)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    check_sampling(**{name: getattr(params, name, None) for name in names})
