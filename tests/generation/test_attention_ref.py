"""The reference paged attention equals dense causal attention over the same tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragserve.generation.attention import AttentionMetadata, get_backend


def _dense(q, k, v, group, q_offset):
    k = k.repeat_interleave(group, 1).transpose(0, 1)
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    q_pos = torch.arange(q_offset, q_offset + q.shape[0])
    mask = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


def test_chunked_paged_attention_matches_dense():
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    k_cache = torch.zeros(16, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    # seq 0: 10 tokens in blocks [3, 5, 9]; seq 1: 3 tokens in block [7].
    tables = torch.tensor([[3, 5, 9], [7, 0, 0]], dtype=torch.int32)
    full_k, full_v = torch.randn(10, kv_heads, dim), torch.randn(10, kv_heads, dim)
    q0 = torch.randn(10, heads, dim)
    q1, k1, v1 = (
        torch.randn(3, heads, dim),
        torch.randn(3, kv_heads, dim),
        torch.randn(3, kv_heads, dim),
    )
    backend = get_backend("torch_ref")

    def slots(table, start, end):
        return [
            int(table[t // block_size]) * block_size + t % block_size for t in range(start, end)
        ]

    # Step 1: seq 0's first chunk (6 tokens) and all of seq 1.
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots(tables[0], 0, 6) + slots(tables[1], 0, 3)),
        query_lens_cpu=(6, 3),
        seq_lens_cpu=(6, 3),
    )
    out = backend.forward(
        torch.cat([q0[:6], q1]),
        torch.cat([full_k[:6], k1]),
        torch.cat([full_v[:6], v1]),
        k_cache,
        v_cache,
        md,
        dim**-0.5,
    )
    torch.testing.assert_close(out[:6], _dense(q0[:6], full_k[:6], full_v[:6], 2, 0))
    torch.testing.assert_close(out[6:], _dense(q1, k1, v1, 2, 0))
    # Step 2: seq 0's remaining 4 tokens attend to the 6 cached ones too.
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([10], dtype=torch.int32),
        block_tables=tables[:1],
        slot_mapping=torch.tensor(slots(tables[0], 6, 10)),
        query_lens_cpu=(4,),
        seq_lens_cpu=(10,),
    )
    out = backend.forward(q0[6:], full_k[6:], full_v[6:], k_cache, v_cache, md, dim**-0.5)
    torch.testing.assert_close(out, _dense(q0, full_k, full_v, 2, 0)[6:])
