"""Paged attention through the Triton unified kernel (``triton_kernels``), registered "triton":
decode steps launch one program per (sequence, kv head, split), others one per (query block,
kv head). On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``; tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve.generation.attention.base import (
    AttentionMetadata,
    BaseAttentionBackend,
    register_backend,
)


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of one launch kind; ``num_splits=None`` picks split-KV by occupancy."""

    block_q: int  # query tokens per program (decode: 1)
    block_n: int  # keys per tile
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None


# NOTE: tiles chosen by bench/bench_attention.py on an H200 (figures: BENCHMARKS.md).
DECODE_CONFIG = KernelConfig(block_q=1, block_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = KernelConfig(block_q=32, block_n=32, num_warps=4, num_stages=3)
TARGET_PROGRAMS = 264  # about two programs per multiprocessor of an H100/H200
MAX_SPLITS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int | None, block_n: int
) -> int:
    """Split-KV factor for a decode launch: enough programs to fill the GPU, a power of 2
    (from the batch shape alone when ``max_seq_len`` is ``None``: CUDA graphs)."""
    want = -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    if max_seq_len is not None:
        want = min(want, -(-max_seq_len // block_n))
    return max(1, min(MAX_SPLITS, _next_pow2(want)))


def _kernels(device: torch.device):
    import triton

    from ragserve.generation.attention.triton_kernels import (
        combine_splits_kernel,
        store_kv_kernel,
        unified_attention_kernel,
    )

    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError("the triton backend runs on CUDA, or on CPU with TRITON_INTERPRET=1")
    return unified_attention_kernel, combine_splits_kernel, store_kv_kernel


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``store_kv`` in one launch; rows whose slot is negative are skipped (graph padding)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "each token's row must be dense"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    _, _, store_kernel = _kernels(k.device)
    store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, ROW_P=_next_pow2(row),
    )  # fmt: skip


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    config: KernelConfig,
    is_decode: bool,
) -> torch.Tensor:
    """Attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged cache."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    num_seqs = metadata.seq_lens.shape[0]
    block_q = 1 if is_decode else config.block_q
    block_m = max(16, _next_pow2(block_q * group))
    head_dim_p = max(16, _next_pow2(head_dim))
    if is_decode:
        num_q_blocks = num_seqs
        splits = config.num_splits or choose_num_splits(
            num_seqs, num_kv_heads, metadata.max_seq_len or None, config.block_n
        )
    else:
        num_q_blocks = num_tokens // block_q + num_seqs
        splits = config.num_splits or 1
    has_q_pos = metadata.query_positions is not None and not is_decode
    q_pos = metadata.query_positions if has_q_pos else metadata.slot_mapping  # unused if not
    out = torch.empty_like(q)
    if splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, splits, head_dim_p, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    attn_kernel, combine_kernel, _ = _kernels(q.device)
    launch = {}
    if q.device.type == "cuda":
        launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    attn_kernel[(num_q_blocks, num_kv_heads, splits)](
        q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        q_pos, out, part_out, part_lse, scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, PAGE=page,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=config.block_n, NUM_SPLITS=splits,
        IS_DECODE=is_decode, HAS_Q_POS=has_q_pos,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **launch,
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=splits,
        )  # fmt: skip
    return out


@register_backend("triton")
class TritonBackend(BaseAttentionBackend):
    """Stores the new keys/values, then runs the unified kernel; a negative slot (CUDA-graph
    padding) stores nothing, and with ``seq_len`` 0 its output is 0."""

    supports_cuda_graphs = True

    def __init__(
        self, decode: KernelConfig = DECODE_CONFIG, prefill: KernelConfig = PREFILL_CONFIG
    ) -> None:
        self.decode_config = decode
        self.prefill_config = prefill

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        store_kv_triton(k, v, k_cache, v_cache, metadata.slot_mapping)
        is_decode = metadata.is_decode_only
        config = self.decode_config if is_decode else self.prefill_config
        return unified_attention(q, k_cache, v_cache, metadata, scale, config, is_decode)
