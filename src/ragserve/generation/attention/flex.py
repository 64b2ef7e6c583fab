"""FlexAttention over gathered blocks, registered "flex".

Each step packs every sequence's context into one contiguous key/value run (a gather through
the block tables) and its new tokens into one query run; a document mask keeps each query on
its own sequence, causally::

    queries  [ seq0 new | seq1 new | ... | pad ]      q_doc, q_pos (kv position of the token)
    keys     [ seq0 ctx      | seq1 ctx   | ... | pad ]  kv_doc, kv_pos

The index tensors and the block mask are built once per step (``prepare``, first layer) and
reused by every layer. On CUDA, ``flex_attention`` is compiled (Triton); on CPU it runs eagerly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ragserve.generation.attention.base import (
    AttentionMetadata,
    BaseAttentionBackend,
    register_backend,
    store_kv,
)

PAD = 128  # packed lengths are rounded up to a whole FlexAttention block


@dataclass(frozen=True)
class _StepLayout:
    kv_slots: torch.Tensor  # int64 [kv_len]: flat cache slot of each packed key (pads: 0)
    num_tokens: int
    block_mask: object


def _pad(n: int) -> int:
    return max(PAD, -(-n // PAD) * PAD)


def _packed_positions(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence id and position within the sequence of each packed row; pads get doc -1."""
    device = lens.device
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens.long())
    starts = torch.cumsum(lens.long(), 0) - lens.long()
    pos = torch.arange(doc.numel(), device=device) - starts[doc]
    fill = total - doc.numel()
    doc = torch.cat([doc, doc.new_full((fill,), -1)])
    pos = torch.cat([pos, pos.new_zeros(fill)])
    return doc, pos


def build_layout(metadata: AttentionMetadata, page: int) -> _StepLayout:
    from torch.nn.attention.flex_attention import create_block_mask

    device = metadata.seq_lens.device
    q_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    q_total, kv_total = _pad(metadata.num_tokens), _pad(sum(metadata.seq_lens_cpu))
    q_doc, q_tok = _packed_positions(q_lens, q_total)
    kv_doc, kv_pos = _packed_positions(metadata.seq_lens, kv_total)
    real = kv_doc >= 0
    doc = kv_doc.clamp(min=0)
    pages = metadata.block_tables[doc, kv_pos // page].long()
    kv_slots = torch.where(real, pages * page + kv_pos % page, 0)
    # kv position of each query token: context before the new tokens + its index among them,
    # or the step's per-query positions (cache fusion)
    if metadata.query_positions is None:
        q_pos = q_tok + (metadata.seq_lens - q_lens).long()[q_doc.clamp(min=0)]
    else:
        q_pos = torch.cat([metadata.query_positions.long(), q_tok[metadata.num_tokens :]])

    def mask_mod(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == kv_doc[kv_idx]) & (q_doc[q_idx] >= 0)
        return same & (kv_pos[kv_idx] <= q_pos[q_idx])

    block_mask = create_block_mask(
        mask_mod, None, None, q_total, kv_total, device=device, _compile=device.type == "cuda"
    )
    return _StepLayout(kv_slots=kv_slots, num_tokens=metadata.num_tokens, block_mask=block_mask)


@register_backend("flex")
class FlexBackend(BaseAttentionBackend):
    """Stores the new keys/values, gathers each context, runs one FlexAttention call."""

    def __init__(self) -> None:
        self._layout: _StepLayout | None = None
        self._layout_for: AttentionMetadata | None = None
        self._flex = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._layout, self._layout_for = None, metadata

    def _attend(self, device: torch.device):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
        return self._flex

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self._layout is None or self._layout_for is not metadata:
            self._layout = build_layout(metadata, k_cache.shape[1])
            self._layout_for = metadata
        layout = self._layout
        num_tokens, num_heads, head_dim = q.shape
        flat = (-1, *k_cache.shape[2:])
        keys = k_cache.view(flat)[layout.kv_slots].transpose(0, 1).unsqueeze(0)
        values = v_cache.view(flat)[layout.kv_slots].transpose(0, 1).unsqueeze(0)
        q_total = layout.block_mask.seq_lengths[0]
        queries = q.new_zeros(q_total, num_heads, head_dim)
        queries[:num_tokens] = q
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            out = self._attend(q.device)(
                queries.transpose(0, 1).unsqueeze(0).to(keys.dtype),
                keys,
                values,
                block_mask=layout.block_mask,
                scale=scale,
                enable_gqa=num_heads != k_cache.shape[2],
            )
        return out[0].transpose(0, 1)[:num_tokens].to(q.dtype)
