"""The reference paged attention equals dense causal attention over the same tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragserve.generation.attention.base import AttentionMetadata, get_backend


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


def test_query_positions_match_dense_masked_attention():
    """Scattered new tokens (cache fusion's rows) over a cache filled elsewhere: query ``j``
    sees exactly the keys at positions ``<= query_positions[j]``, in float64 by hand."""
    from attention_cases import SCATTERED, make_case, run_backend

    case = make_case(SCATTERED, num_heads=4, num_kv_heads=2, head_dim=8, page=8, scattered=True)
    out, k_cache, v_cache = run_backend(get_backend("torch_ref"), case)
    md = case.metadata
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:]).double()
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:]).double()
    new_slots = set(md.slot_mapping.tolist())
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
        pos = torch.arange(seq_len)
        slots = md.block_tables[i, pos // 8].long() * 8 + pos % 8
        keys = flat_k[slots].repeat_interleave(2, 1)  # [seq_len, heads, dim]
        values = flat_v[slots].repeat_interleave(2, 1)
        for j in range(start, start + q_len):
            p = int(md.query_positions[j])
            assert int(slots[p]) in new_slots  # the query's own key was stored this step
            scores = torch.einsum("hd,nhd->hn", case.q[j].double(), keys[: p + 1]) * case.scale
            want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[: p + 1])
            torch.testing.assert_close(out[j].double(), want, atol=1e-5, rtol=0)
        start += q_len
