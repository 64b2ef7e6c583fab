"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm)
over a step's tokens packed flat (``[num_tokens, ...]``); q/k/v and gate/up are fused,
``load_weight`` maps HF names. Serves every supported architecture."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ragserve.generation.attention.base import AttentionMetadata, BaseAttentionBackend
from ragserve.generation.config import ModelConfig, ModelLoadError


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


KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def qkv(self, positions: torch.Tensor, x: torch.Tensor):
        """Queries, keys (normed, rotated) and values of ``x`` ``[num_tokens, hidden]``."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: BaseAttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv(positions, x)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, kv_cache, metadata, backend) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, metadata, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[num_tokens, hidden]``; ``compute_logits``
    turns selected rows into float32 logits. Mutates only the KV caches it is given."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        backend: BaseAttentionBackend,
    ) -> torch.Tensor:
        backend.prepare(metadata)
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, kv_cache, metadata, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def expected_weight_names(self) -> set[str]:
        """HF checkpoint names this model needs (``lm_head`` omitted when tied)."""
        return set(self._weight_targets)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one HF-named tensor into place; ``False`` if the model has no such weight."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        target = self._weight_targets.get(name)
        if target is None:
            return False
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
        return True

    @functools.cached_property
    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF name -> the parameter (or the slice of a fused one) it fills; built on first use,
        once the parameters are materialised (a tied ``lm_head`` is not listed)."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        ff = cfg.intermediate_size
        shards = {
            ".qkv_proj.": {".q_proj.": (0, q), ".k_proj.": (q, kv), ".v_proj.": (q + kv, kv)},
            ".gate_up_proj.": {".gate_proj.": (0, ff), ".up_proj.": (ff, ff)},
        }
        targets = {}
        for name, param in self.named_parameters():
            fused = next((f for f in shards if f in name), None)
            if fused is None:
                targets[name] = param
            for hf, (start, size) in shards.get(fused, {}).items():
                targets[name.replace(fused, hf)] = param.narrow(0, start, size)
        return targets
