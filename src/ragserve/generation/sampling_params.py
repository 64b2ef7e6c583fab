"""Per-request decoding knobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    ``temperature == 0`` is greedy (``top_p``/``top_k``/``seed`` are then ignored). With a
    ``seed`` the request samples from its own ``torch.Generator``, so its tokens do not depend
    on what else is in the batch. ``stop`` strings end generation and are cut from ``text``
    (the token ids keep the token that completed them); ``stop_token_ids`` and the model's EOS
    end it too (EOS is ignored with ``ignore_eos``).
    """

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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
