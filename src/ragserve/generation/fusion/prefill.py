"""The fused prefill of one request: each keyed segment's stored KV (tree blocks or the
``PassageKVStore``), re-rotated to its start, is written into the request's blocks; the
selector picks the rows to recompute, which the model runner runs in the step's batch.

A selector scores every token and ``pick_rows`` takes the ``ceil(ratio * n)`` top-scored of
each keyed segment. ``"qcfuse"``: attention the query pays at a probe layer; ``"cacheblend"``:
layer-1 KV deviation; ``"sift"``: attention each token receives inside its passage alone.

Partial forwards of one sequence: the QCFuse probe over the paged cache (``probe_attention``)
and ``forward_rows``: ``rows`` through the layers over a dense ``kv`` ``[2, num_layers,
num_tokens, kv_heads, head_dim]`` (keys after RoPE), each row writing its own KV and attending
causally to every entry::

    positions  0 ........................................... num_tokens - 1
    kv         [ fresh | stored (re-rotated) | fresh | stored | fresh .... ]
    rows         x x x      x       x           x x x    x       x x x x
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ragserve.generation.attention.base import AttentionMetadata, BaseAttentionBackend, store_kv
from ragserve.generation.config import EngineConfig
from ragserve.generation.fusion.store import PassageKVStore
from ragserve.generation.kv_tree import PassageBlocks
from ragserve.generation.llama import RotaryEmbedding, rotate_half
from ragserve.generation.sampler import to_device
from ragserve.generation.segments import FusionPlan, num_picked

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
SIFT_INDEX_ENTRIES = 4096  # passages whose SIFT-style scores are kept (n floats each)


class FusionRunner:
    """Runs fused prefills on a model's paged KV cache; owns the passage store and counters."""

    def __init__(self, model: nn.Module, config: EngineConfig):
        num_layers = len(model.model.layers)
        probe_layer = config.fusion_probe_layer
        if probe_layer is not None and not 0 <= probe_layer < num_layers:
            raise ValueError(f"fusion_probe_layer must be in [0, {num_layers}), got {probe_layer}")
        self.model = model
        device = next(model.parameters()).device
        budgets = config.fusion_kv_cache_bytes, config.fusion_host_kv_cache_bytes
        self.store = PassageKVStore(device, *budgets)
        self.selector = config.fusion_selector
        self.probe_layer = max(1, num_layers // 4) if probe_layer is None else probe_layer
        self.probe_layer = min(self.probe_layer, num_layers - 1)
        self.paged = config.fusion_paged_prefill
        self.batch_misses = config.fusion_batch_misses  # a step's missing passages in one forward
        self.num_fused_tokens = 0
        self.num_recomputed_tokens = 0
        self._sift_index: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def step_passage_kvs(
        self,
        prefills: list[tuple[list[int], FusionPlan, list[PassageBlocks] | None]],
        kv_cache: torch.Tensor,
    ) -> list[list[torch.Tensor] | None]:
        """With ``batch_misses``, the stored KV of every keyed span of a step's fused prefills
        ``(token_ids, plan, passages)``, what all of them miss in one forward, one list a
        prefill; without, ``None`` each (``prepare`` then computes a miss per passage)."""
        if not self.batch_misses:
            return [None] * len(prefills)
        own = [_keyed_spans(*prefill) for prefill in prefills]
        # NOTE: an engine's fused prefills all hold tree blocks (with the knowledge tree) or
        # none (the store's passages), never a mix
        handles = [h for *_, passages in prefills for h in passages or ()] or None
        spans = [s for prefill_spans in own for s in prefill_spans]
        if handles is not None and len(handles) != len(spans):
            raise AssertionError(f"{len(handles)} passage blocks for {len(spans)} keyed spans")
        kvs = iter(self._passage_kvs(spans, handles, kv_cache))
        return [[next(kvs) for _ in spans] for spans in own]

    def passage_kv(self, key: str, token_ids: list[int]) -> torch.Tensor:
        """Stored KV of a passage at positions ``0..n-1`` (computed and stored on a miss)."""
        return self._passage_kvs([(key, token_ids)], None, None)[0]

    def _passage_kvs(
        self,
        spans: list[tuple[str, list[int]]],
        handles: list[PassageBlocks] | None,
        kv_cache: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """Each ``(key, tokens)``'s KV at positions ``0..n-1``: from the store (``handles``
        None) or its ready blocks; the misses computed alone, each distinct passage once and,
        with ``batch_misses``, all in one forward, then stored or written to their blocks."""
        found: list[torch.Tensor | None] = []
        for i, (key, tokens) in enumerate(spans):
            if handles is None:
                found.append(self.store.get(key, tokens))
            elif handles[i].is_ready:
                found.append(_flat(kv_cache)[:, :, self._passage_slots(handles[i], kv_cache, 0)])
            else:
                found.append(None)
        todo: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for i, kv in enumerate(found):
            if kv is None:
                todo.setdefault((spans[i][0], tuple(spans[i][1])), []).append(i)
        passages = [list(tokens) for _, tokens in todo]
        groups = [passages] if self.batch_misses else [[t] for t in passages]
        computed = [kv for group in groups if group for kv in self._compute_alone_many(group)]
        for ((key, tokens), where), kv in zip(todo.items(), computed, strict=True):
            if handles is None:
                self.store.put(key, list(tokens), kv)
            for i in where:
                found[i] = kv
                if handles is not None and handles[i].blocks and not handles[i].is_ready:
                    first = handles[i].num_ready_blocks * kv_cache.shape[3]
                    slots = self._passage_slots(handles[i], kv_cache, first)
                    _flat(kv_cache)[:, :, slots] = kv[:, :, first:]
                    handles[i].num_ready_blocks = len(handles[i].blocks)
        return found

    @staticmethod
    def _passage_slots(handle: PassageBlocks, kv_cache: torch.Tensor, first: int) -> torch.Tensor:
        block_size = kv_cache.shape[3]
        dev = kv_cache.device
        pos = torch.arange(first, len(handle.token_ids), device=dev)
        blocks = to_device(handle.blocks, dev, torch.long)
        return blocks[pos // block_size] * block_size + pos % block_size

    def _compute_alone_many(self, passages: list[list[int]]) -> list[torch.Tensor]:
        """Each passage's KV at positions ``0..n-1`` as if computed alone: one forward over
        them packed, attention kept within each passage (block-diagonal causal mask)."""
        sizes = [len(t) for t in passages]
        kv = self._empty_kv(sum(sizes))
        dev = kv.device
        ids = to_device([t for p in passages for t in p], dev, torch.long)
        rows = torch.arange(len(ids), device=dev)
        lengths = to_device(sizes, dev, torch.long)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        segments = torch.repeat_interleave(torch.arange(len(sizes), device=dev), lengths)
        forward_rows(self.model, ids, kv, rows, positions=rows - starts, segments=segments)
        return list(torch.split(kv, sizes, dim=2))

    def _empty_kv(self, num_tokens: int, num_layers: int | None = None) -> torch.Tensor:
        attn = self.model.model.layers[0].self_attn
        param = next(self.model.parameters())
        num_layers = num_layers or len(self.model.model.layers)
        shape = (2, num_layers, num_tokens, attn.num_kv_heads, attn.head_dim)
        return torch.zeros(shape, dtype=param.dtype, device=param.device)

    @torch.inference_mode()
    def prepare(
        self,
        token_ids: list[int],
        plan: FusionPlan,
        kv_cache: torch.Tensor,
        block_table: list[int],
        backend: BaseAttentionBackend,
        passages: list[PassageBlocks] | None = None,
        kvs: list[torch.Tensor] | None = None,
    ) -> list[int]:
        """Write each keyed segment's stored KV (re-rotated) into the sequence's blocks; the
        sorted rows to compute. ``passages``: held blocks in span order (``None``: the store);
        ``kvs``: the segments' KV already fetched (``step_passage_kvs``)."""
        num_tokens = len(token_ids)
        dev = kv_cache.device
        page = kv_cache.shape[3]
        flat = _flat(kv_cache)
        kv_caches = [(kv_cache[0, i], kv_cache[1, i]) for i in range(kv_cache.shape[1])]
        table = to_device(block_table, dev, torch.long)
        pos = torch.arange(num_tokens, device=dev)
        slots = table[pos // page] * page + pos % page
        rotary = self.model.model.rotary
        keyed = [(s, e, key) for s, e, key in plan.spans if key is not None]
        fused = [False] * num_tokens
        if kvs is None:
            kvs = self._passage_kvs(_keyed_spans(token_ids, plan, passages), passages, kv_cache)
        for (start, end, _), stored in zip(keyed, kvs, strict=True):
            fused[start:end] = [True] * (end - start)
            flat[0][:, slots[start:end]] = rotate_keys(stored[0], rotary, start).to(flat.dtype)
            flat[1][:, slots[start:end]] = stored[1].to(flat.dtype)
        # the last token's logits are sampled: always computed
        base = [p for p in range(num_tokens - 1) if not fused[p]] + [num_tokens - 1]
        ids = to_device(token_ids, dev, torch.long)
        extra = self._select(ids, base, plan, kv_caches, table, slots, backend)
        rows = sorted(set(base).union(extra))
        self.num_fused_tokens += plan.num_keyed_tokens
        self.num_recomputed_tokens += sum(fused[p] for p in rows)
        if not self.paged:  # the dense forward; its last row runs again in the batch (same)
            kv = flat[:, :, slots]
            forward_rows(self.model, ids, kv, to_device(rows, dev, torch.long))
            flat[:, :, slots] = kv
            return [num_tokens - 1]
        return rows

    def _select(
        self,
        ids: torch.Tensor,
        base: list[int],
        plan: FusionPlan,
        kv_caches: KVCaches,
        table: torch.Tensor,
        slots: torch.Tensor,
        backend: BaseAttentionBackend,
    ) -> list[int]:
        """Positions of keyed tokens to recompute (``plan.ratio`` of each keyed segment)."""
        if plan.ratio == 0.0:
            return []
        num_tokens = ids.shape[0]
        if plan.ratio == 1.0:
            scores = torch.zeros(num_tokens, device=ids.device)
        elif self.selector == "qcfuse":
            rows = to_device(base, ids.device, torch.long)
            query = to_device(query_rows(plan.spans, num_tokens), ids.device, torch.long)
            probs = probe_attention(
                self.model, ids, rows, query, kv_caches, slots, table, backend, self.probe_layer
            )
            scores = attention_scores(probs, query, query)
        elif self.selector == "sift":
            scores = torch.zeros(num_tokens, device=ids.device)
            for start, end, key in plan.spans:
                if key is not None:
                    scores[start:end] = self.passage_scores(key, ids[start:end].tolist())
        else:
            scores = self._kv_deviation(ids, kv_caches, slots)
        return pick_rows(scores, plan.spans, plan.ratio)

    @torch.inference_mode()
    def passage_scores(self, key: str, token_ids: list[int]) -> torch.Tensor:
        """The SIFT-style index of a passage: ``[n]`` attention each token receives from the
        passage alone at the probe layer (kept for the last ``SIFT_INDEX_ENTRIES``)."""
        full_key = (key, tuple(token_ids))
        scores = self._sift_index.get(full_key)
        if scores is not None:
            self._sift_index.move_to_end(full_key)
            return scores
        work = self._empty_kv(len(token_ids))
        ids = to_device(token_ids, work.device, torch.long)
        rows = torch.arange(len(token_ids), device=work.device)
        _, probs = forward_rows(self.model, ids, work, rows, probe_layer=self.probe_layer)
        scores = received_attention(probs)
        self._sift_index[full_key] = scores
        if len(self._sift_index) > SIFT_INDEX_ENTRIES:
            self._sift_index.popitem(last=False)
        return scores

    def _kv_deviation(self, ids: torch.Tensor, kv_caches: KVCaches, slots: torch.Tensor):
        """``[num_tokens]`` distance of each token's fresh layer-1 KV from the cached one."""
        if len(self.model.model.layers) == 1:  # one layer: nothing deviates but RoPE, exact
            return torch.zeros(ids.shape[0], device=ids.device)
        everything = torch.arange(ids.shape[0], device=ids.device)
        work = self._empty_kv(ids.shape[0], num_layers=1)
        hidden, _ = forward_rows(self.model, ids, work, everything, num_layers=1)
        layer = self.model.model.layers[1]
        _, fresh_k, fresh_v = layer.self_attn.qkv(everything, layer.input_layernorm(hidden))
        k_cache, v_cache = kv_caches[1]
        flat = (-1, *k_cache.shape[2:])
        stored = torch.stack([k_cache.view(flat)[slots], v_cache.view(flat)[slots]])
        return kv_deviation(torch.stack([fresh_k, fresh_v]), stored)


def _keyed_spans(
    token_ids: list[int], plan: FusionPlan, passages: list[PassageBlocks] | None
) -> list[tuple[str, list[int]]]:
    """``(key, tokens)`` of each keyed segment; ``passages`` must hold one handle each."""
    spans = [(key, token_ids[start:end]) for start, end, key in plan.spans if key is not None]
    if passages is not None and len(passages) != len(spans):
        raise ValueError(f"passages: {len(passages)} handles for {len(spans)} keyed spans")
    return spans


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[2, num_layers, num_slots, kv_heads, head_dim]`` view of the paged cache."""
    return kv_cache.view(2, kv_cache.shape[1], -1, *kv_cache.shape[4:])


def query_rows(spans: Sequence[tuple[int, int, str | None]], num_tokens: int) -> list[int]:
    """Positions of the query: unkeyed tokens after the last keyed segment, else the last."""
    last_keyed_end = max((e for _, e, key in spans if key is not None), default=0)
    rows = list(range(last_keyed_end, num_tokens))
    return rows or [num_tokens - 1]


def attention_scores(probs: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Per-token attention received from the ``query`` positions: ``probs`` is ``[heads,
    len(rows), num_tokens]`` for the computed ``rows``; returns ``[num_tokens]``."""
    picked = torch.isin(rows, query)
    return probs[:, picked].float().sum(dim=(0, 1))


def received_attention(probs: torch.Tensor) -> torch.Tensor:
    """``[n]`` attention each key receives, summed over heads and queries, from ``probs``
    ``[heads, n, n]`` (a passage attending to itself, causally)."""
    return probs.float().sum(dim=(0, 1))


def kv_deviation(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``[num_tokens]`` L2 distance between fresh and stored ``[2, num_tokens, heads, dim]``."""
    diff = (fresh.float() - stored.float()).pow(2)
    return diff.sum(dim=(0, 2, 3)).sqrt()


def pick_rows(
    scores: torch.Tensor, spans: Sequence[tuple[int, int, str | None]], ratio: float
) -> list[int]:
    """The top ``ceil(ratio * n)`` positions of each keyed segment by ``scores`` (sorted); one
    device-to-host copy for all segments (each copy waits for the device)."""
    picked: list[torch.Tensor] = []
    for start, end, key in spans:
        if key is None:
            continue
        num = num_picked(end - start, ratio)
        if num <= 0:
            continue
        seg = scores[start:end].float()
        # NOTE: stable descending sort so equal scores keep the earlier token first.
        picked.append(torch.sort(-seg, stable=True).indices[:num] + start)
    return sorted(torch.cat(picked).tolist()) if picked else []


def rotate_keys(keys: torch.Tensor, rotary: RotaryEmbedding, delta: int) -> torch.Tensor:
    """Keys rotated for positions ``p`` -> the same keys at ``p + delta`` (``delta >= 0``):
    RoPE rotations compose, so one extra rotation by ``theta * delta`` moves every key."""
    if delta == 0:
        return keys
    return keys * rotary.cos[delta] + rotate_half(keys) * rotary.sin[delta]


def forward_rows(
    model: nn.Module,
    token_ids: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    num_layers: int | None = None,
    probe_layer: int | None = None,
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``rows`` through ``num_layers`` layers (default all; up to ``probe_layer``) writing
    their KV into ``kv``; returns their hidden states and the probe's probabilities or None.
    ``positions``/``segments`` (per ``kv`` entry): RoPE positions other than the entry's index,
    and independent sequences packed in one ``kv`` (a row attends only within its segment)."""
    layers = model.model.layers
    stop = len(layers) if num_layers is None else num_layers
    if probe_layer is not None:
        stop = probe_layer + 1
    num_tokens = kv.shape[2]
    mask = torch.arange(num_tokens, device=rows.device)[None, :] <= rows[:, None]
    if segments is not None:
        mask &= segments[None, :] == segments[rows][:, None]
    row_positions = rows if positions is None else positions[rows]
    x = model.model.embed_tokens(token_ids[rows])
    probs = None
    for index in range(stop):
        layer = layers[index]
        attn = layer.self_attn
        q, k, v = attn.qkv(row_positions, layer.input_layernorm(x))
        kv[0, index, rows] = k.to(kv.dtype)
        kv[1, index, rows] = v.to(kv.dtype)
        group = attn.num_heads // attn.num_kv_heads
        keys = kv[0, index].transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)  # [H, N, D]
        values = kv[1, index].transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
        qh = q.transpose(0, 1)  # [heads, rows, D]
        if index == probe_layer:
            scores = (qh.float() @ keys.float().transpose(1, 2)) * attn.scale
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = (probs.to(values.dtype) @ values).transpose(0, 1)
        else:
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, scale=attn.scale
            ).transpose(0, 1)
        x = x + attn.o_proj(out.reshape(len(rows), attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, probs


def probe_attention(
    model: nn.Module,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    query: torch.Tensor,
    kv_caches: KVCaches,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    backend: BaseAttentionBackend,
    probe_layer: int,
) -> torch.Tensor:
    """Attention probabilities ``[heads, len(query), num_tokens]`` of ``query`` (within ``rows``)
    at ``probe_layer``; ``rows`` (sorted positions, the last ``num_tokens - 1``) run the paged
    layers below it with per-query positions, writing their KV; ``slots``: every position's."""
    num_tokens, dev = len(slots), rows.device
    metadata = AttentionMetadata(
        query_start_loc=to_device([0, len(rows)], dev, torch.int32),
        seq_lens=to_device([num_tokens], dev, torch.int32),
        block_tables=block_table[None].to(torch.int32),
        slot_mapping=slots[rows],
        query_lens_cpu=(len(rows),),
        seq_lens_cpu=(num_tokens,),
        query_positions=rows,
    )
    layers = model.model.layers
    backend.prepare(metadata)
    x = model.model.embed_tokens(token_ids[rows])
    for index in range(probe_layer):
        x = layers[index](rows, x, kv_caches[index], metadata, backend)
    attn = layers[probe_layer].self_attn
    q, k, v = attn.qkv(rows, layers[probe_layer].input_layernorm(x))
    k_cache, v_cache = kv_caches[probe_layer]
    store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    keys = k_cache.view(-1, *k_cache.shape[2:])[slots].float()  # [num_tokens, kv_heads, D]
    group = attn.num_heads // attn.num_kv_heads
    qq = q[torch.isin(rows, query)].float()
    qq = qq.view(len(qq), attn.num_kv_heads, group, attn.head_dim)
    scores = torch.einsum("qkgd,nkd->kgqn", qq, keys).flatten(0, 1) * attn.scale
    mask = torch.arange(num_tokens, device=dev)[None, :] <= query[:, None]
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)
