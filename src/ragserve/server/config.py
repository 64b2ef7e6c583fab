"""Configuration of the HTTP front, built once at the edge (CLI or tests) and never mutated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """How the OpenAI-compatible HTTP front listens and protects itself.

    ``max_num_inflight`` bounds the generation requests (chat and completions) admitted at
    once; past it a request gets 429 with ``Retry-After: retry_after_s``. Document upserts,
    ``/v1/models``, ``/metrics`` and ``/health`` are not counted. ``api_key`` of ``None``
    disables auth. ``drain_timeout_s`` is how long a graceful shutdown waits for in-flight
    requests before cancelling them.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "ragserve"
    max_num_inflight: int = 64
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    default_max_tokens: int = 256
    disconnect_poll_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_num_inflight < 1:
            raise ValueError(f"max_num_inflight must be >= 1, got {self.max_num_inflight}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
