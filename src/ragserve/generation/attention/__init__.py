"""Paged attention backends behind one contract (see ``base``)."""

from ragserve.generation.attention import (  # noqa: F401  (each registers its backend)
    torch_ref,
    triton_backend,
)
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
