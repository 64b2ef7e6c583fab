"""Paged attention backends behind one contract (``base``); importing the package registers
"triton" beside ``base``'s "torch_ref"."""

from ragserve.generation.attention import triton_backend  # noqa: F401
