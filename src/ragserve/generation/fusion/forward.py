"""Partial forwards of one sequence for cache fusion: the QCFuse probe over the paged cache
(``probe_attention``) and ``forward_rows``: ``rows`` through the layers over a dense ``kv``
``[2, num_layers, num_tokens, kv_heads, head_dim]`` (keys after RoPE), each row writing its
own KV and attending causally to every entry::

    positions  0 ........................................... num_tokens - 1
    kv         [ fresh | stored (re-rotated) | fresh | stored | fresh .... ]
    rows         x x x      x       x           x x x    x       x x x x
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ragserve.generation.attention.base import AttentionMetadata, BaseAttentionBackend, store_kv
from ragserve.generation.llama import RotaryEmbedding, rotate_half
from ragserve.generation.sampler import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def rotate_keys(keys: torch.Tensor, rotary: RotaryEmbedding, delta: int) -> torch.Tensor:
    """Keys rotated for positions ``p`` -> the same keys at ``p + delta`` (``delta >= 0``):
    RoPE rotations compose, so one extra rotation by ``theta * delta`` moves every key."""
    if delta == 0:
        return keys
    return keys * rotary.cos[delta] + rotate_half(keys) * rotary.sin[delta]


def _qkv(layer: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    return layer.self_attn.qkv(positions, layer.input_layernorm(x))


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
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``rows`` through ``num_layers`` layers (default all; up to ``probe_layer``) writing
    their KV into ``kv``; returns their hidden states and the probe's probabilities or None.
    ``positions``/``segments`` (per ``kv`` entry): RoPE positions other than the entry's index,
    and independent sequences packed in one ``kv`` (a row attends only within its segment)."""
    layers = model.model.layers
    stop = len(layers) if num_layers is None else num_layers
    if probe_layer is not None:
        stop = probe_layer + 1
    num_tokens = kv.shape[2]
    mask = torch.arange(num_tokens, device=rows.device)[None, :] <= rows[:, None]
    if segments is not None:
        mask &= segments[None, :] == segments[rows][:, None]
    row_positions = rows if positions is None else positions[rows]
    x = model.model.embed_tokens(token_ids[rows])
    probs = None
    for index in range(stop):
        layer = layers[index]
        attn = layer.self_attn
        q, k, v = _qkv(layer, x, row_positions)
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


def rows_metadata(
    rows: torch.Tensor, num_tokens: int, slots: torch.Tensor, block_table: torch.Tensor
) -> AttentionMetadata:
    """One sequence of ``num_tokens`` whose new tokens are ``rows`` (sorted positions, the last
    ``num_tokens - 1``) with per-query positions; ``slots``: every position's flat slot."""
    dev = rows.device
    return AttentionMetadata(
        query_start_loc=to_device([0, len(rows)], dev, torch.int32),
        seq_lens=to_device([num_tokens], dev, torch.int32),
        block_tables=block_table[None].to(torch.int32),
        slot_mapping=slots[rows],
        query_lens_cpu=(len(rows),),
        seq_lens_cpu=(num_tokens,),
        query_positions=rows,
    )


def probe_attention(
    model: nn.Module,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    query: torch.Tensor,
    kv_caches: KVCaches,
    metadata: AttentionMetadata,
    backend: BaseAttentionBackend,
    probe_layer: int,
) -> torch.Tensor:
    """Attention probabilities ``[heads, len(query), num_tokens]`` of ``query`` (within ``rows``)
    at ``probe_layer``; ``rows`` run the paged layers below it, writing their KV."""
    layers = model.model.layers
    backend.prepare(metadata)
    x = model.model.embed_tokens(token_ids[rows])
    for index in range(probe_layer):
        x = layers[index](rows, x, kv_caches[index], metadata, backend)
    attn = layers[probe_layer].self_attn
    q, k, v = _qkv(layers[probe_layer], x, rows)
    k_cache, v_cache = kv_caches[probe_layer]
    store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    num_tokens = metadata.seq_lens_cpu[0]
    pos = torch.arange(num_tokens, device=rows.device)
    page = k_cache.shape[1]
    slots = metadata.block_tables[0, pos // page].long() * page + pos % page
    keys = k_cache.view(-1, *k_cache.shape[2:])[slots].float()  # [num_tokens, kv_heads, D]
    group = attn.num_heads // attn.num_kv_heads
    qq = q[torch.isin(rows, query)].float()
    qq = qq.view(len(qq), attn.num_kv_heads, group, attn.head_dim)
    scores = torch.einsum("qkgd,nkd->kgqn", qq, keys).flatten(0, 1) * attn.scale
    mask = pos[None, :] <= query[:, None]
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)
