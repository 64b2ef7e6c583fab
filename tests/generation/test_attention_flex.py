"""The FlexAttention backend equals the torch_ref backend on random paged batches."""

from __future__ import annotations

import pytest
import torch
from attention_cases import CHUNKED, DECODE, MIXED, PREFILL, SCATTERED, make_case, run_backend

from ragserve.generation.attention import get_backend

CASES = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED}


def _check(lens, *, device: str, dtype: torch.dtype, atol: float, **shape) -> None:
    case = make_case(lens, device=device, dtype=dtype, **shape)
    _compare(case, atol)


def _compare(case, atol: float) -> None:
    ref_out, ref_k, ref_v = run_backend(get_backend("torch_ref"), case)
    backend = get_backend("flex")
    backend.prepare(case.metadata)
    out, k_cache, v_cache = run_backend(backend, case)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)


def test_cpu_matches_reference_and_reuses_the_layout() -> None:
    """A mixed batch (decodes, prefills, chunks after a cached prefix); the step's layout is
    built once for every layer and dropped by the next ``prepare``."""
    case = make_case(MIXED, num_heads=4, head_dim=16)
    _compare(case, atol=1e-4)
    backend = get_backend("flex")
    backend.prepare(case.metadata)
    run_backend(backend, case)
    layout = backend._layout
    run_backend(backend, case)
    assert backend._layout is layout
    backend.prepare(case.metadata)
    assert backend._layout is None


def test_query_positions_match_reference() -> None:
    """Cache fusion's scattered rows (``query_positions``) mask like the reference."""
    case = make_case(SCATTERED[:4], num_heads=4, head_dim=16, scattered=True)
    _compare(case, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(CASES))
def test_gpu_matches_reference(kind: str) -> None:
    _check(CASES[kind], device="cuda", dtype=torch.bfloat16, atol=2e-2, num_heads=32,
           num_kv_heads=8, head_dim=128)  # fmt: skip
