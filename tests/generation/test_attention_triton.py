"""The Triton unified kernel equals the torch_ref backend on random paged batches.

CPU: the same kernels under Triton's interpreter (skipped where triton is not installed).
GPU (``gpu``): compiled, in float32 and bfloat16, with and without split-KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_cases import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    SCATTERED,
    make_case,
    run_backend,
)

from ragserve.generation.attention.base import get_backend

HERE = Path(__file__).parent
CASES = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED}
SCATTERED_SMALL = [(q, min(s, 70)) for q, s in SCATTERED if min(s, 70) >= q]


def _check(lens, *, device, dtype, atol, backend=None, scattered=False, **shape) -> None:
    from ragserve.generation.attention.triton_backend import TritonBackend

    case = make_case(lens, device=device, dtype=dtype, scattered=scattered, **shape)
    ref_out, ref_k, ref_v = run_backend(get_backend("torch_ref"), case)
    out, k_cache, v_cache = run_backend(backend or TritonBackend(), case)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)


def _check_padding_rows(device: str, dtype: torch.dtype) -> None:
    """Rows with slot -1 and seq_len 0 (CUDA graph padding) store nothing and output 0."""
    from dataclasses import replace

    from ragserve.generation.attention.triton_backend import TritonBackend

    case = make_case([(1, 20), (1, 1), (1, 1)], device=device, dtype=dtype, num_heads=4,
                     head_dim=16)  # fmt: skip
    md = case.metadata
    md = replace(
        md,
        seq_lens=torch.tensor([20, 0, 0], dtype=torch.int32, device=device),
        slot_mapping=torch.cat([md.slot_mapping[:1], md.slot_mapping.new_full((2,), -1)]),
        seq_lens_cpu=(20, 0, 0),
    )
    padded = replace(case, metadata=md)
    ref_out, _, _ = run_backend(get_backend("torch_ref"), case)
    out, k_cache, _ = run_backend(TritonBackend(), padded)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    torch.testing.assert_close(out[:1].float(), ref_out[:1].float(), atol=1e-2, rtol=0)
    changed = (k_cache != case.k_cache).flatten(1).any(1)
    assert changed.sum() == 1  # only the real token's block was written


def _fix_interpreter_scalars() -> None:
    # NOTE: Triton 3.6's interpreter turns a loaded scalar into a 1-element array, which
    # `range(lo, hi)` cannot take under numpy 2; index the single element instead.
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def interpreter_checks(full: bool) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is imported).
    Not ``full``: one small mixed batch (prefill, chunk, decode) and one of scattered rows."""
    _fix_interpreter_scalars()
    from ragserve.generation.attention.triton_backend import (
        DECODE_CONFIG,
        KernelConfig,
        TritonBackend,
    )

    small_q = TritonBackend(decode=DECODE_CONFIG, prefill=KernelConfig(block_q=4, block_n=16))
    if not full:
        _check([(1, 37), (13, 13), (3, 17)], device="cpu", dtype=torch.float32, atol=1e-4,
               num_heads=4, head_dim=16)  # fmt: skip
        _check([(9, 20), (1, 5)], device="cpu", dtype=torch.float32, atol=1e-4, scattered=True,
               backend=small_q, num_heads=6, num_kv_heads=2, head_dim=24, page=4)  # fmt: skip
        return
    for kind in ("mixed", "decode", "chunked"):
        lens = [(q, min(s, 70)) for q, s in CASES[kind] if min(s, 70) >= q][:5]
        _check(lens, device="cpu", dtype=torch.float32, atol=1e-4, num_heads=4, head_dim=16)
    split = TritonBackend(decode=KernelConfig(block_q=1, block_n=16, num_splits=4))
    _check([(1, 50), (1, 3), (1, 33)], device="cpu", dtype=torch.float32, atol=1e-4,
           backend=split, num_heads=4, num_kv_heads=4, head_dim=16, page=8)  # fmt: skip
    _check([(9, 20), (1, 5), (6, 6)], device="cpu", dtype=torch.float32, atol=1e-4,
           backend=small_q, num_heads=6, num_kv_heads=2, head_dim=24, page=4)  # fmt: skip
    _check_padding_rows("cpu", torch.float32)
    _check(SCATTERED_SMALL, device="cpu", dtype=torch.float32, atol=1e-4, scattered=True,
           backend=small_q, num_heads=4, head_dim=16, page=8)  # fmt: skip
    _check([(9, 20), (1, 5), (5, 40)], device="cpu", dtype=torch.float32, atol=1e-4,
           scattered=True, backend=small_q, num_heads=6, num_kv_heads=2, head_dim=24,
           page=4)  # fmt: skip


@pytest.mark.parametrize(
    "full", [False, pytest.param(True, marks=pytest.mark.slow, id="sweep")], ids=["small", None]
)
def test_interpreter_matches_reference(full: bool) -> None:
    """On CPU: a small mixed batch and scattered rows (per-query positions), and in the same
    interpreter process the fused RMSNorm/rotary kernels (``test_attention_fused_ops``); the
    sweep (``slow``) adds decode and chunked batches, split-KV, MHA, odd head sizes and
    padding rows."""
    pytest.importorskip("triton")
    from testing import run_in_triton_interpreter

    code = f"import test_attention_triton as t; t.interpreter_checks({full})"
    if not full:
        code += "; import torch, test_attention_fused_ops as f; f.check_fused('cpu', torch.float32)"
    run_in_triton_interpreter(HERE, code)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(kind: str, dtype: torch.dtype) -> None:
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    _check(CASES[kind], device="cuda", dtype=dtype, atol=atol)
    _check(CASES[kind], device="cuda", dtype=dtype, atol=atol, num_heads=32, num_kv_heads=8,
           head_dim=128)  # fmt: skip


@pytest.mark.gpu
def test_gpu_padding_rows() -> None:
    _check_padding_rows("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 8, 32])
def test_gpu_split_kv(splits: int) -> None:
    from ragserve.generation.attention.triton_backend import KernelConfig, TritonBackend

    backend = TritonBackend(decode=KernelConfig(block_q=1, block_n=64, num_splits=splits))
    _check(DECODE, device="cuda", dtype=torch.bfloat16, atol=2e-2, backend=backend,
           num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_query_positions_match_reference(dtype: torch.dtype) -> None:
    """Cache fusion's scattered rows through the compiled prefill kernel (Llama-8B heads too),
    and a batch of several fused prefills' rows beside ordinary chunks."""
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    _check(SCATTERED, device="cuda", dtype=dtype, atol=atol, scattered=True)
    _check(SCATTERED, device="cuda", dtype=dtype, atol=atol, scattered=True, num_heads=32,
           num_kv_heads=8, head_dim=128)  # fmt: skip
    fused_batch = [(832, 5184), (800, 5184), (65, 65), (1, 900)]
    _check(fused_batch, device="cuda", dtype=dtype, atol=atol, scattered=True, num_heads=32,
           num_kv_heads=8, head_dim=128)  # fmt: skip
