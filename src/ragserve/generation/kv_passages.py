"""Cache fusion's passage KV inside the knowledge tree's tiers: a passage is a chain of cached
blocks seeded by ``hash(("passage", key, token ids))``, owned by one ``KVNode``, ref counted
while a fused prefill reads it, otherwise evicted and swapped like any tree block::

    passage "p" (n = 2.5 blocks)   seed = hash(("passage", "p", tokens))
    blocks  [ b0: tokens 0..bs-1 ] -> [ b1: bs..2bs-1 ] -> [ b2: 2bs..n-1 | unused ]
    hashes    h(seed, t0)             h(h0, t1)            h(h1, t2)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ragserve.generation.block_manager import extend_block_hashes
from ragserve.generation.kv_tree import CachedBlock, PassageBlocks


class PassageTierMixin:
    """``acquire_passages`` / ``release_passages`` for ``TieredBlockManager``."""

    def _init_passages(self) -> None:
        self._passage_holds: dict[str, list[PassageBlocks]] = {}  # rid -> held passages
        self._pending_passages: dict[int, PassageBlocks] = {}  # node key -> not yet written
        self.num_passage_hits = 0
        self.num_passage_misses = 0

    @staticmethod
    def passage_seed(key: str, token_ids: Seq[int]) -> int:
        """The node key and chain seed of passage ``key`` holding ``token_ids``."""
        return hash(("passage", key, tuple(token_ids)))

    def acquire_passages(
        self, request_id: str, passages: Seq[tuple[str, Seq[int]]], num_extra_blocks: int
    ) -> list[PassageBlocks] | None:
        """One handle per ``(key, token ids)`` held for a fused prefill, keeping
        ``num_extra_blocks`` allocatable (else ``None``: nothing changed); GPU passages are held
        first, one that does not fit is unstored (``blocks == ()``). May evict and swap."""
        if num_extra_blocks > self.num_free_blocks:
            return None
        if request_id in self._passage_holds:
            raise ValueError(f"request {request_id!r} already holds passages")
        seeds = [self.passage_seed(key, token_ids) for key, token_ids in passages]
        distinct: dict[int, PassageBlocks] = {}
        for seed, (key, token_ids) in zip(seeds, passages, strict=True):
            distinct.setdefault(seed, PassageBlocks(key, tuple(int(t) for t in token_ids)))
        budget = self.num_free_blocks - num_extra_blocks
        is_held: dict[int, bool] = {}
        for seed, handle in distinct.items():  # phase 1: hold what is on the GPU
            cached, _ = self._passage_chain(seed, handle.token_ids)
            on_gpu = [e for e in cached if e.gpu_block is not None]
            cost = sum(1 for e in on_gpu if self.ref_cnt[e.gpu_block] == 0)
            is_held[seed] = cost <= budget
            if is_held[seed]:
                budget -= cost
                for entry in on_gpu:
                    self._acquire(entry.gpu_block)
                handle.entries = on_gpu
        for seed in distinct:  # phase 2: share, swap in, store new, or leave unstored
            pending = self._pending_passages.get(seed)
            if pending is not None:  # written this step by an earlier request: share it
                distinct[seed] = pending
                self.num_passage_hits += 1
                self.policy.on_access(pending.entries[0].node)
            elif is_held[seed]:
                budget = self._complete_passage(seed, distinct[seed], budget)
            else:
                self.num_passage_misses += 1
        self._passage_holds[request_id] = [h for h in distinct.values() if h.blocks]
        return [distinct[seed] for seed in seeds]

    def _passage_chain(
        self, seed: int, token_ids: tuple[int, ...]
    ) -> tuple[list[CachedBlock], list[int]]:
        """(cached leading blocks of the passage, chained hashes of all its blocks)."""
        num_blocks = -(-len(token_ids) // self.block_size)
        hashes = extend_block_hashes([], token_ids, num_blocks, self.block_size, seed)
        return self._cached_prefix(hashes), hashes

    def _complete_passage(self, seed: int, handle: PassageBlocks, budget: int) -> int:
        """Swap in the held passage's host blocks and store its missing ones within
        ``budget`` (else release it); returns the budget left."""
        cached, hashes = self._passage_chain(seed, handle.token_ids)
        on_host = cached[len(handle.entries) :]
        num_new = len(hashes) - len(cached)
        if len(on_host) + num_new > budget:
            self._release([e.gpu_block for e in handle.entries])
            handle.entries = []
            self.num_passage_misses += 1
            return budget
        for entry in on_host:
            entry.locked = True
        for entry in on_host:
            self._swap_in(entry)
            handle.entries.append(entry)
        node = self.nodes.get(seed) or self._new_node(seed, None, 0, len(handle.token_ids))
        for i in range(len(cached), len(hashes)):
            block = self._pop_block()
            parent = handle.entries[-1] if handle.entries else None
            handle.entries.append(self._new_entry(hashes[i], parent, node, i, block))
        self.policy.on_access(node)
        handle.blocks = tuple(e.gpu_block for e in handle.entries)
        handle.num_ready_blocks = len(cached)
        if num_new:
            self._pending_passages[seed] = handle
            self.num_passage_misses += 1
        else:
            self.num_passage_hits += 1
        return budget - len(on_host) - num_new

    def release_passages(self, request_id: str) -> None:
        """Drop the request's holds (unknown: no-op); a passage still unwritten is forgotten."""
        for handle in self._passage_holds.pop(request_id, []):
            seed = self.passage_seed(handle.key, handle.token_ids)
            if self._pending_passages.get(seed) is handle:
                del self._pending_passages[seed]
            self._release([e.gpu_block for e in handle.entries])
            if not handle.is_ready:
                self._forget_unwritten(handle)

    def _forget_unwritten(self, handle: PassageBlocks) -> None:
        for entry in reversed(handle.entries[handle.num_ready_blocks :]):
            if entry.is_alive and entry.gpu_block is not None and self.ref_cnt[entry.gpu_block]:
                continue
            if entry.is_alive and entry.gpu_block is not None and not entry.children:
                block = entry.gpu_block
                self._evict_gpu(entry, swap=False)
                self.free_blocks.append(block)
