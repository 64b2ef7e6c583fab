"""Paged attention backends behind one contract (see ``base``)."""

from ragserve.generation.attention import triton_backend  # noqa: F401  (registers "triton")
from ragserve.generation.attention.base import (
    AttentionMetadata,
    BaseAttentionBackend,
    available_backends,
    get_backend,
    resolve_backend,
)

__all__ = [
    "AttentionMetadata",
    "BaseAttentionBackend",
    "available_backends",
    "get_backend",
    "resolve_backend",
]
