"""Configuration of the HTTP front, built once at the edge and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

_COUNTS = (
    "max_num_inflight",
    "max_body_bytes",
    "max_connections",
    "max_json_depth",
    "max_num_upserts",
)


@dataclass(frozen=True)
class ServeConfig:
    """How the HTTP front listens and protects itself. ``max_num_inflight`` bounds the chats
    and completions admitted at once (past it: 429 with ``Retry-After: retry_after_s``),
    ``max_num_upserts`` the document upserts/deletes; ``api_key`` ``None`` disables auth; a
    client has ``header_timeout_s`` for a request's headers and ``body_timeout_s`` for its body
    (else 408); past ``max_connections`` a request gets 503; ``tokenizer`` (the LLM's folder or
    built-in name) serves ``/tokenize`` and ``/detokenize`` (``None``: 404)."""

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
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "drain_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
