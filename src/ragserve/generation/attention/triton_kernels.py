"""Triton kernels for paged attention: one "unified" kernel for decode and prefill chunks.

One program handles one query block of one sequence for one kv head and all ``GROUP`` query
heads sharing it (GQA), so every key/value tile is used by ``GROUP`` heads at once::

    row r  ->  token  local_block * BLOCK_Q + r // GROUP,   q head  kv_head * GROUP + r % GROUP

Sequence ``i``'s first query block is ``query_start_loc[i] // BLOCK_Q + i`` (grid: ``num_tokens
// BLOCK_Q + num_seqs``, spare programs return); a program finds its sequence by binary search,
so the launch is the same for every step of a shape (decode: program ``i`` is sequence ``i``).
Split-KV: ``NUM_SPLITS`` programs per query block write partial outputs and log-sum-exps that
``combine_splits_kernel`` merges. ``HAS_Q_POS``: query token ``t`` sits at ``q_pos[t]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unified_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                             query_start_loc_ptr, q_pos_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                             scale, num_seqs, stride_q_tok, stride_q_head, stride_o_tok,
                             stride_o_head, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
                             NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HEAD_DIM_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             IS_DECODE: tl.constexpr, HAS_Q_POS: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):  # fmt: skip
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        seq = qb
        q_start = qb
        q_len = 1
        local = 0
    else:
        # largest seq with query_start_loc[seq] // BLOCK_Q + seq <= qb (binary search)
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first_block <= qb:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local = qb - (q_start // BLOCK_Q + seq)
        if local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_tok = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # keys this block can see end after its last query token (causal)
    if HAS_Q_POS:
        q_pos = tl.load(q_pos_ptr + q_tok, mask=row_ok, other=0).to(tl.int32)
        kv_end = tl.minimum(tl.max(q_pos, 0) + 1, seq_len)
    else:
        q_pos = ctx_before + tok
        kv_end = tl.minimum(ctx_before + (local + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        off = page * stride_c_blk + (n % PAGE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        ok = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS > 1:
        # partials: [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM_P] and lse [.., NUM_SPLITS]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part_row = (q_tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM_P + d[None, :], out, mask=row_ok[:, None]
        )
    else:
        tl.store(
            out_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                          NUM_SPLITS: tl.constexpr):  # fmt: skip
    """One program per (token, head): weight each split's output by exp2(lse - max lse)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tok * NUM_HEADS + head
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM_P + d[None, :])
    total = tl.sum(w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(parts * w[:, None], 0) / total
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_k_tok,
                    stride_v_tok, ROW: tl.constexpr, ROW_P: tl.constexpr):  # fmt: skip
    """One program per new token: copy its ``[num_kv_heads * head_dim]`` key and value rows to
    its flat cache slot; a negative slot (a padding row of a CUDA graph batch) is skipped."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    i = tl.arange(0, ROW_P)
    ok = i < ROW
    k = tl.load(k_ptr + tok * stride_k_tok + i, mask=ok)
    v = tl.load(v_ptr + tok * stride_v_tok + i, mask=ok)
    tl.store(k_cache_ptr + slot * ROW + i, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + slot * ROW + i, v.to(v_cache_ptr.dtype.element_ty), mask=ok)
