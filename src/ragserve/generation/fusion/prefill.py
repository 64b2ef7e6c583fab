"""The fused prefill of one request: stored passage KV + selective recompute -> paged cache.

1. Each keyed segment's KV at positions ``0..n-1`` comes from its blocks in the paged cache
   (``PassageBlocks`` held by the knowledge tree's tiers, ``kv_passages.py``; computed alone
   and written there on a miss) or, without the tree, from the ``PassageKVStore``; keys are
   re-rotated to the segment's start.
2. The selector scores the tokens; ``ceil(ratio * n)`` of each keyed segment are recomputed
   together with every unkeyed token (and the last token, whose logits are sampled).
3. One dense forward over those rows (``forward.py``); then every token's KV is written into
   the request's blocks, so decoding continues on the paged cache like any request.

``ratio = 1.0`` recomputes every token: a full prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from ragserve.generation.attention.base import store_kv
from ragserve.generation.fusion.forward import forward_rows, project_kv, rotate_keys
from ragserve.generation.fusion.selectors import (
    FUSION_SELECTORS,
    attention_scores,
    kv_deviation,
    pick_rows,
    query_rows,
    received_attention,
)
from ragserve.generation.fusion.store import PassageKVStore
from ragserve.generation.kv_passages import PassageBlocks

Span = tuple[int, int, str | None]
SIFT_INDEX_ENTRIES = 4096  # passages whose SIFT-style scores are kept (n floats each)


@dataclass(frozen=True)
class FusionPlan:
    """A request's segments as ``(start, end, key)`` token spans and its recompute ratio."""

    spans: tuple[Span, ...]
    ratio: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be in [0, 1], got {self.ratio}")

    @property
    def num_keyed_tokens(self) -> int:
        return sum(e - s for s, e, key in self.spans if key is not None)


class FusionRunner:
    """Runs fused prefills on a model's paged KV cache; owns the passage store and counters.

    ``prefill`` mutates the cache blocks named by the request's block table and the store.
    """

    def __init__(
        self,
        model: nn.Module,
        store: PassageKVStore,
        *,
        selector: str = "qcfuse",
        probe_layer: int | None = None,
    ):
        num_layers = len(model.model.layers)
        if selector not in FUSION_SELECTORS:
            raise ValueError(f"unknown fusion_selector {selector!r}; use one of {FUSION_SELECTORS}")
        if probe_layer is not None and not 0 <= probe_layer < num_layers:
            raise ValueError(f"fusion_probe_layer must be in [0, {num_layers}), got {probe_layer}")
        self.model = model
        self.store = store
        self.selector = selector
        self.probe_layer = max(1, num_layers // 4) if probe_layer is None else probe_layer
        self.probe_layer = min(self.probe_layer, num_layers - 1)
        self.num_fused_tokens = 0
        self.num_recomputed_tokens = 0
        self._sift_index: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def passage_kv(self, key: str, token_ids: list[int]) -> torch.Tensor:
        """Stored KV of a passage at positions ``0..n-1`` (computed and stored on a miss)."""
        kv = self.store.get(key, token_ids)
        if kv is None:
            kv = self._compute_alone(token_ids)
            self.store.put(key, token_ids, kv)
        return kv

    def paged_passage_kv(
        self,
        handle: PassageBlocks,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """A passage's KV at positions ``0..n-1`` read from its blocks in the paged cache;
        computed alone first (and written to its unwritten blocks, if any) unless ready."""
        if handle.is_ready:
            slots = self._passage_slots(handle, kv_caches, 0)
            k = torch.stack([kc.view(-1, *kc.shape[2:])[slots] for kc, _ in kv_caches])
            v = torch.stack([vc.view(-1, *vc.shape[2:])[slots] for _, vc in kv_caches])
            return torch.stack([k, v])
        kv = self._compute_alone(list(handle.token_ids))
        if handle.blocks:
            first = handle.num_ready_blocks * kv_caches[0][0].shape[1]
            slots = self._passage_slots(handle, kv_caches, first)
            for layer, (k_cache, v_cache) in enumerate(kv_caches):
                store_kv(kv[0, layer, first:], kv[1, layer, first:], k_cache, v_cache, slots)
            handle.num_ready_blocks = len(handle.blocks)
        return kv

    @staticmethod
    def _passage_slots(
        handle: PassageBlocks, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], first: int
    ) -> torch.Tensor:
        block_size = kv_caches[0][0].shape[1]
        dev = kv_caches[0][0].device
        pos = torch.arange(first, len(handle.token_ids), device=dev)
        blocks = torch.tensor(handle.blocks, dtype=torch.long, device=dev)
        return blocks[pos // block_size] * block_size + pos % block_size

    def _compute_alone(self, token_ids: list[int]) -> torch.Tensor:
        kv = self._empty_kv(len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long, device=kv.device)
        forward_rows(self.model, ids, kv, torch.arange(len(token_ids), device=kv.device))
        return kv

    def _empty_kv(self, num_tokens: int) -> torch.Tensor:
        attn = self.model.model.layers[0].self_attn
        param = next(self.model.parameters())
        shape = (2, len(self.model.model.layers), num_tokens, attn.num_kv_heads, attn.head_dim)
        return torch.zeros(shape, dtype=param.dtype, device=param.device)

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        plan: FusionPlan,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        passages: list[PassageBlocks] | None = None,
    ) -> torch.Tensor:
        """Fill ``slots`` (one flat cache slot per token) with the fused KV of ``token_ids``
        and return the last token's final hidden state ``[hidden]`` (after the final norm).
        ``passages``: the keyed segments' held blocks, in span order (``None``: use the
        store). Tokens past the planned spans (generated before a preemption) are computed
        like unkeyed ones."""
        kv = self._empty_kv(len(token_ids))
        dev = kv.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        rotary = self.model.model.rotary
        keyed = [(s, e, key) for s, e, key in plan.spans if key is not None]
        if passages is not None and len(passages) != len(keyed):
            raise ValueError(f"passages: {len(passages)} handles for {len(keyed)} keyed spans")
        for i, (start, end, key) in enumerate(keyed):
            if passages is None:
                stored = self.passage_kv(key, token_ids[start:end])
            else:
                stored = self.paged_passage_kv(passages[i], kv_caches)
            kv[0, :, start:end] = rotate_keys(stored[0], rotary, start)
            kv[1, :, start:end] = stored[1]
        in_keyed = torch.zeros(len(token_ids), dtype=torch.bool, device=dev)
        for start, end, _ in keyed:
            in_keyed[start:end] = True
        fused = in_keyed.clone()
        in_keyed[-1] = False  # the last token's logits are sampled: always computed
        base = (~in_keyed).nonzero().flatten()
        extra = self._select(ids, kv, base, plan)
        rows = torch.unique(torch.cat([base, torch.tensor(extra, dtype=torch.long, device=dev)]))
        hidden, _ = forward_rows(self.model, ids, kv, rows)
        for layer, (k_cache, v_cache) in enumerate(kv_caches):
            store_kv(kv[0, layer], kv[1, layer], k_cache, v_cache, slots)
        self.num_fused_tokens += plan.num_keyed_tokens
        self.num_recomputed_tokens += int(fused[rows].sum())
        return self.model.model.norm(hidden[-1])

    def _select(
        self, ids: torch.Tensor, kv: torch.Tensor, base: torch.Tensor, plan: FusionPlan
    ) -> list[int]:
        """Positions of keyed tokens to recompute (``plan.ratio`` of each keyed segment)."""
        if plan.ratio == 0.0:
            return []
        num_tokens = kv.shape[2]
        if plan.ratio == 1.0:
            scores = torch.zeros(num_tokens, device=kv.device)
        elif self.selector == "qcfuse":
            scores = self._query_attention(ids, kv, base, plan)
        elif self.selector == "sift":
            scores = torch.zeros(num_tokens, device=kv.device)
            for start, end, key in plan.spans:
                if key is not None:
                    scores[start:end] = self.passage_scores(key, ids[start:end].tolist())
        else:
            scores = self._kv_deviation(ids, kv)
        return pick_rows(scores, plan.spans, plan.ratio)

    @torch.inference_mode()
    def passage_scores(self, key: str, token_ids: list[int]) -> torch.Tensor:
        """The SIFT-style index of a passage: ``[n]`` attention each token receives from the
        passage alone at the probe layer (computed on first use, kept for the last
        ``SIFT_INDEX_ENTRIES`` passages)."""
        full_key = (key, tuple(token_ids))
        scores = self._sift_index.get(full_key)
        if scores is not None:
            self._sift_index.move_to_end(full_key)
            return scores
        work = self._empty_kv(len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long, device=work.device)
        rows = torch.arange(len(token_ids), device=work.device)
        _, probs = forward_rows(self.model, ids, work, rows, probe_layer=self.probe_layer)
        scores = received_attention(probs)
        self._sift_index[full_key] = scores
        if len(self._sift_index) > SIFT_INDEX_ENTRIES:
            self._sift_index.popitem(last=False)
        return scores

    def _query_attention(
        self, ids: torch.Tensor, kv: torch.Tensor, base: torch.Tensor, plan: FusionPlan
    ) -> torch.Tensor:
        # NOTE: the probe writes fresh KV of the unkeyed rows up to the probe layer; the main
        # forward recomputes those rows at every layer, so nothing of the probe survives.
        _, probs = forward_rows(self.model, ids, kv, base, probe_layer=self.probe_layer)
        query = torch.tensor(query_rows(plan.spans, kv.shape[2]), device=kv.device)
        return attention_scores(probs, base, query)

    def _kv_deviation(self, ids: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        everything = torch.arange(kv.shape[2], device=kv.device)
        stored = kv[:, 1].clone()
        hidden, _ = forward_rows(self.model, ids, kv.clone(), everything, num_layers=1)
        layer = min(1, len(self.model.model.layers) - 1)
        if layer == 0:  # one layer: nothing deviates but RoPE, already exact
            return torch.zeros(kv.shape[2], device=kv.device)
        fresh_k, fresh_v = project_kv(self.model.model.layers[layer], hidden, everything)
        return kv_deviation(torch.stack([fresh_k, fresh_v]), stored)
