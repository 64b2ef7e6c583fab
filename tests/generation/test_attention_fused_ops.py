"""Fused RMSNorm and rotary kernels match the eager op sequences of ``llama.py``.

CPU: under Triton's interpreter, in the subprocess of ``test_attention_triton``'s small
interpreter test (one interpreter start for both); GPU: compiled, bf16 and float32.
"""

from __future__ import annotations

import pytest
import torch


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _eager_rotary(positions, x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def _tables(dim: int, positions: int, dtype, device):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def check_fused(device: str, dtype: torch.dtype) -> None:
    from ragserve.generation.attention.fused_ops import rms_norm, rotary_qk

    g = torch.Generator().manual_seed(0)
    for rows, n in ((5, 64), (3, 96), (1, 4096)):
        x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(device)
        w = torch.randn(n, generator=g).to(dtype).to(device)
        torch.testing.assert_close(rms_norm(x, w, 1e-5), _eager_rms_norm(x, w, 1e-5))
    heads, kv_heads, dim, tokens = 4, 2, 32, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    pos = torch.tensor([0, 5, 1, 99, 3, 3, 64], device=device)
    cos, sin = _tables(dim, 128, dtype, device)
    rq, rk = rotary_qk(pos, q, k, cos, sin)  # adjacent: one launch
    # one rounding instead of eager's three: never further from the float64 result than eager
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for fused, x in ((rq, q), (rk, k)):
        exact = _eager_rotary(pos, x.double(), cos.double(), sin.double())
        eager = _eager_rotary(pos, x, cos, sin)
        torch.testing.assert_close(fused.double(), exact, atol=tol, rtol=tol)
        ulp = torch.finfo(dtype).eps * exact.abs().max()
        assert (fused - exact).abs().max() <= (eager - exact).abs().max() + ulp
    rk2, rq2 = rotary_qk(pos, k, q, cos, sin)  # not adjacent: two launches
    assert torch.equal(rq2, rq) and torch.equal(rk2, rk)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_eager(dtype: torch.dtype) -> None:
    check_fused("cuda", dtype)
