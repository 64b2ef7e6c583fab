"""Per-request decoding knobs."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.graph.checks import check_sampling_of


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes: ``temperature == 0`` is greedy; a ``seed`` gives the request
    its own generator; ``stop`` strings end it and are cut from ``text`` (not the token ids).
    Ranges: ``graph/checks.py``."""

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
        check_sampling_of(self)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
