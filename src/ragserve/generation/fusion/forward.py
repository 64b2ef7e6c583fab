"""Dense forward of one sequence where only some tokens are (re)computed.

The sequence's KV for every layer is a dense tensor ``kv`` of shape ``[2, num_layers,
num_tokens, num_kv_heads, head_dim]`` (keys after RoPE). ``rows`` (sorted positions) are
the tokens computed: at each layer their fresh keys/values overwrite ``kv`` and they attend,
causally by position, to every token's entry in ``kv``; the other tokens keep whatever
``kv`` holds (stored passage KV). With ``rows`` = every position this is a full prefill::

    positions  0 ........................................... num_tokens - 1
    kv         [ fresh | stored (re-rotated) | fresh | stored | fresh .... ]
    rows         x x x      x       x           x x x    x       x x x x
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ragserve.generation.models.layers import RotaryEmbedding


def rotate_keys(keys: torch.Tensor, rotary: RotaryEmbedding, delta: int) -> torch.Tensor:
    """Keys rotated for positions ``p`` -> the same keys at ``p + delta`` (``delta >= 0``).

    RoPE rotates each frequency pair by ``theta * p``; rotations compose, so one extra
    rotation by ``theta * delta`` moves every key at once. ``keys``: ``[..., head_dim]``.
    """
    if delta == 0:
        return keys
    cos, sin = rotary.cos[delta], rotary.sin[delta]
    half = keys.shape[-1] // 2
    rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return keys * cos + rotated * sin


def _qkv(layer: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    n = x.shape[0]
    q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(n, attn.num_heads, attn.head_dim)
    k = k.view(n, attn.num_kv_heads, attn.head_dim)
    v = v.view(n, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rotary(positions, q, k)
    return q, k, v


def project_kv(
    layer: nn.Module, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values a layer would write for hidden states ``x`` at ``positions``."""
    _, k, v = _qkv(layer, x, positions)
    return k, v


def _context(cache: torch.Tensor, group: int) -> torch.Tensor:
    return cache.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, N, D]


def forward_rows(
    model: nn.Module,
    token_ids: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    num_layers: int | None = None,
    probe_layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compute ``rows`` through the first ``num_layers`` layers (all by default), writing their
    keys/values into ``kv``; returns their hidden states after the last layer run (before the
    final norm) and, with ``probe_layer``, that layer's attention probabilities
    ``[heads, len(rows), num_tokens]`` (the run then stops after it). Mutates ``kv`` only.
    """
    layers = model.model.layers
    stop = len(layers) if num_layers is None else num_layers
    if probe_layer is not None:
        stop = probe_layer + 1
    num_tokens = kv.shape[2]
    mask = torch.arange(num_tokens, device=rows.device)[None, :] <= rows[:, None]
    x = model.model.embed_tokens(token_ids[rows])
    probs = None
    for index in range(stop):
        layer = layers[index]
        attn = layer.self_attn
        q, k, v = _qkv(layer, x, rows)
        kv[0, index, rows] = k.to(kv.dtype)
        kv[1, index, rows] = v.to(kv.dtype)
        group = attn.num_heads // attn.num_kv_heads
        keys = _context(kv[0, index], group).to(q.dtype)
        values = _context(kv[1, index], group).to(q.dtype)
        qh = q.transpose(0, 1)  # [heads, rows, D]
        if index == probe_layer:
            scores = (qh.float() @ keys.float().transpose(1, 2)) * attn.scale
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = (probs.to(values.dtype) @ values).transpose(0, 1)
        else:
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, scale=attn.scale
            ).transpose(0, 1)
        x = x + attn.o_proj(out.reshape(len(rows), attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, probs
