"""Resolve ``attention_backend="auto"`` to a registered backend for a device.

NOTE: the CUDA choice comes from ``bench/bench_attention.py`` on an H200 (figures in
BENCHMARKS.md, "LLM engine"): the Triton unified kernel beat FlexAttention over gathered
blocks and the per-sequence SDPA reference for decode at every batch size measured.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device | str) -> str:
    """``name`` itself unless it is ``"auto"``: then the fastest backend that runs on ``device``."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda" and has_triton():
        return "triton"
    if device.type == "cuda":
        logger.warning("triton is not installed; falling back to the torch_ref attention backend")
    return "torch_ref"
