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

    Connections and bodies are bounded: a client has ``header_timeout_s`` to send a request's
    headers (also on a kept-alive connection: then counted from its first byte),
    ``body_timeout_s`` to send its body (else 408); an idle kept-alive connection closes after
    ``keep_alive_s``; past ``max_connections`` open connections a request gets 503. A body
    nested deeper than ``max_json_depth`` is a 400; ``max_num_upserts`` bounds the document
    upserts/deletes in flight (past it: 429). ``tokenizer`` (the LLM's folder or built-in
    name) serves ``/tokenize`` and ``/detokenize`` (``None``: they are 404).
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
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024
    max_json_depth: int = 64
    max_num_upserts: int = 8
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_inflight < 1:
            raise ValueError(f"max_num_inflight must be >= 1, got {self.max_num_inflight}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "drain_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        for name in ("max_connections", "max_json_depth", "max_num_upserts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
