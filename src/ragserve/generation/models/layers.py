"""Building blocks shared by the decoder models (flat token layout: ``[num_tokens, ...]``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ragserve.generation.errors import ModelLoadError


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as in Llama/Qwen reference code."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == x.dtype:  # one fused kernel (attention/fused_ops)
            from ragserve.generation.attention.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies (float32) for ``rope_type`` default, linear or llama3."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"config.json: unsupported rope_type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = dict(scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill the tables on ``device`` (called once after the model is materialised)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = (inv_freq[:, None] @ pos[None, :]).t()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda and self.cos.dtype == q.dtype:  # one fused kernel (attention/fused_ops)
            from ragserve.generation.attention.fused_ops import can_rotate, rotary_qk

            if can_rotate(self.head_dim):
                return rotary_qk(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
