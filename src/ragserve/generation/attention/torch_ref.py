"""Reference paged attention (CPU, and the oracle for faster backends): gather each sequence's
blocks, then one SDPA per sequence with a causal offset or per-query positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragserve.generation.attention.base import (
    AttentionMetadata,
    BaseAttentionBackend,
    register_backend,
    store_kv,
)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of a sequence: ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


@register_backend("torch_ref")
class TorchRefBackend(BaseAttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            ki = gather_context(k_cache, metadata.block_tables[i], seq_len)
            vi = gather_context(v_cache, metadata.block_tables[i], seq_len)
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            if metadata.query_positions is None:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            else:
                q_pos = metadata.query_positions[start : start + q_len]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start : start + q_len] = oi.transpose(0, 1)
            start += q_len
        return out
