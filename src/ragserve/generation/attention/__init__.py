"""Paged attention backends behind one contract (see ``base``)."""

from ragserve.generation.attention import torch_ref  # noqa: F401  (registers "torch_ref")
from ragserve.generation.attention.base import (
    AttentionMetadata,
    BaseAttentionBackend,
    available_backends,
    get_backend,
    register_backend,
    store_kv,
)

__all__ = [
    "AttentionMetadata",
    "BaseAttentionBackend",
    "available_backends",
    "get_backend",
    "register_backend",
    "store_kv",
]
