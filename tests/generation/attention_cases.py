"""Random paged-attention batches shared by the backend tests (not a test module itself)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve.generation.attention.base import AttentionMetadata


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_case(
    lens: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    page: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    scattered: bool = False,
) -> Case:
    """A batch over a cache whose pages are shuffled, with random cached prefixes; with
    ``scattered`` each sequence's new tokens are ``query_len`` random positions (increasing,
    the last at ``seq_len - 1``) given as ``query_positions`` (cache fusion's rows)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // page) for _, s in lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    num_tokens = sum(q for q, _ in lens)
    slots, positions = [], []
    for i, (q_len, seq_len) in enumerate(lens):
        chosen = range(seq_len - q_len, seq_len)
        if scattered:
            rest = torch.randperm(seq_len - 1, generator=g)[: q_len - 1]
            chosen = sorted(rest.tolist()) + [seq_len - 1]
        for t in chosen:
            slots.append(int(tables[i, t // page]) * page + t % page)
            positions.append(t)
    qsl = [0]
    for q_len, _ in lens:
        qsl.append(qsl[-1] + q_len)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dtype).to(device)

    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=tuple(q for q, _ in lens),
        seq_lens_cpu=tuple(s for _, s in lens),
        query_positions=(
            torch.tensor(positions, dtype=torch.int64, device=device) if scattered else None
        ),
    )
    return Case(
        q=rnd(num_tokens, num_heads, head_dim),
        k=rnd(num_tokens, num_kv_heads, head_dim),
        v=rnd(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        metadata=md,
        scale=head_dim**-0.5,
    )


def run_backend(backend, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output and the caches after one forward, on copies (the case stays untouched)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, case.metadata, case.scale)
    return out, k_cache, v_cache


# A mix: decode over short and long contexts, full prefills, chunks after a cached prefix.
MIXED = [(1, 37), (13, 13), (1, 1), (40, 95), (7, 200), (1, 130), (64, 64), (3, 17)]
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 333), (1, 64), (1, 1000)]
PREFILL = [(130, 130), (77, 77)]
CHUNKED = [(33, 160), (16, 16 + 48), (5, 300)]
# Cache fusion's scattered rows (``scattered=True``): few rows over long prompts, a whole
# prompt, one row (the last token only), beside rows of ordinary shape.
SCATTERED = [(40, 300), (130, 130), (1, 77), (9, 20), (64, 1000), (3, 3)]
