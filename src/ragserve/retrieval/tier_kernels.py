"""Triton kernel of the GPU tier's fused scan (``tier_scan.fused_scan``): each probed chunk is
read once, in place, and scored against every query slot of its run::

    grid (runs, cdiv(S, BLOCK_N), cdiv(mpad, BLOCK_M))
    program (r, nb, mb): slots  slot0 + r * mpad + [mb * BLOCK_M, (mb + 1) * BLOCK_M)
                         rows   nb * BLOCK_N + [0, BLOCK_N) of chunk run_chunk[run0 + r]
    keys[dslot, row] = scale * q[qslot] . x[chunk, row] + bias[chunk, row]

Padding slots have ``dslot == dump``. ``DIM`` is walked in ``BLOCK_D`` steps, accumulated in
float32: ``tl.dot`` (IEEE on float32 pools) when ``USE_DOT``, else an FMA loop (no padding).
"""

from __future__ import annotations

import triton
import triton.language as tl


# NOTE: the launch's integers are not specialized (== 1, % 16), so that each block size
# compiles once (``tier_scan.fused_warm_up``) whatever the batch's offsets and padding
@triton.jit(do_not_specialize=["run0", "slot0", "mpad", "dump"])
def chunk_scan_kernel(
    q_ptr,
    x_ptr,
    bias_ptr,
    qslot_ptr,
    dslot_ptr,
    run_chunk_ptr,
    out_ptr,
    run0,
    slot0,
    mpad,
    dump,
    scale,
    DIM: tl.constexpr,
    S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    nb = tl.program_id(1)
    mb = tl.program_id(2)
    chunk = tl.load(run_chunk_ptr + run0 + r).to(tl.int64)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < mpad
    slot = slot0 + r.to(tl.int64) * mpad + m
    qrow = tl.load(qslot_ptr + slot, mask=m_ok, other=0)
    dst = tl.load(dslot_ptr + slot, mask=m_ok, other=dump)
    live = m_ok & (dst != dump)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < S
    x_rows = x_ptr + (chunk * S + n) * DIM
    q_rows = q_ptr + qrow * DIM
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for d0 in range(0, DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            q_ok = live[:, None] & (d < DIM)[None, :]
            q = tl.load(q_rows[:, None] + d[None, :], mask=q_ok, other=0.0)
            x_ok = n_ok[:, None] & (d < DIM)[None, :]
            x = tl.load(x_rows[:, None] + d[None, :], mask=x_ok, other=0.0)
            acc = tl.dot(q, tl.trans(x), acc, input_precision=DOT_PRECISION)
    else:
        # NOTE: products summed per lane across the steps, reduced across lanes once at the end
        part = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_D], tl.float32)
        for d0 in range(0, DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            q_ok = live[:, None] & (d < DIM)[None, :]
            q = tl.load(q_rows[:, None] + d[None, :], mask=q_ok, other=0.0)
            x_ok = n_ok[:, None] & (d < DIM)[None, :]
            x = tl.load(x_rows[:, None] + d[None, :], mask=x_ok, other=0.0)
            part += q.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        acc = tl.sum(part, axis=2)
    bias = tl.load(bias_ptr + chunk * S + n, mask=n_ok, other=float("-inf"))
    keys = acc * scale + bias[None, :]
    out = out_ptr + dst[:, None] * S + n[None, :]
    tl.store(out, keys, mask=live[:, None] & n_ok[None, :])
