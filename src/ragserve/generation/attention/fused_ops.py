"""Fused Triton kernels for the layers around attention on CUDA: RMSNorm and rotary embedding.

A decode step at small batch is bound by kernel count, not bytes: the eager RMSNorm is eight
elementwise kernels and the rotate-half rotary about twelve, per layer. Each fused kernel here
does one pass in float32 and rounds once at the end, so it differs from the eager op sequence
(which rounds every intermediate to the model dtype) by at most about one unit in the last
place; ``tests/generation/test_attention_fused_ops.py`` bounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, eps, N: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    normed = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)  # x32.to(dtype)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + i, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` in one kernel."""
    assert x.stride(-1) == 1 and weight.dtype == x.dtype
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), eps, N=n,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8,
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_x_tok, stride_x_head,
                 stride_out_tok, stride_table, NUM_HEADS: tl.constexpr,
                 HEADS_P: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """One program per token: all heads, rotate-half convention."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < NUM_HEADS
    base = x_ptr + tok * stride_x_tok + h * stride_x_head
    x1 = tl.load(base + d, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + d, mask=ok, other=0.0)
    dt = x1.dtype
    cos1 = tl.load(cos_ptr + pos * stride_table + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_table + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_table + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_table + HALF + d).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), in float32
    o1 = f1 * cos1 - f2 * sin1
    o2 = f2 * cos2 + f1 * sin2
    obase = out_ptr + tok * stride_out_tok + h * HALF * 2
    tl.store(obase + d, o1.to(dt), mask=ok)
    tl.store(obase + HALF + d, o2.to(dt), mask=ok)


def can_rotate(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def rotary(
    positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``x * cos[pos] + rotate_half(x) * sin[pos]`` for ``x`` ``[num_tokens, heads, dim]``."""
    num_tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.dtype == x.dtype and can_rotate(dim)
    out = torch.empty(num_tokens, heads, dim, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            x, out, positions, cos, sin, x.stride(0), x.stride(1), out.stride(0), cos.stride(0),
            NUM_HEADS=heads, HEADS_P=triton.next_power_of_2(heads), HALF=dim // 2, num_warps=4,
        )  # fmt: skip
    return out


def rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k; one launch when k's heads follow q's in memory (a fused qkv output)."""
    num_tokens, heads, dim = q.shape
    adjacent = (
        k.stride() == q.stride()
        and q.stride(1) == dim
        and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
    )
    if not adjacent:
        return rotary(positions, q, cos, sin), rotary(positions, k, cos, sin)
    both = q.as_strided((num_tokens, heads + k.shape[1], dim), q.stride())
    out = rotary(positions, both, cos, sin)
    return out[:, :heads], out[:, heads:]
