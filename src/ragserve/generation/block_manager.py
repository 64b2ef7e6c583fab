"""Paged KV blocks with automatic prefix caching (the plain, GPU-only cache): chained block
hashes, so equal hashes mean equal prefixes; free blocks keep their hashes until reallocated,
least recently freed first::

    free queue   front [ unhashed blocks | hashed blocks, least recently freed first ] back

Mutates ``seq.block_table`` in place, never ``num_computed_tokens``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence as Seq
from itertools import takewhile

from ragserve.generation.sequence import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained hash of one full block (stable within a process)."""
    return hash((parent_hash, tuple(token_ids)))


def extend_block_hashes(
    hashes: list[int], token_ids: Seq[int], num_blocks: int, block_size: int, seed=None
) -> list[int]:
    """Extend ``hashes`` (chained hashes so far, mutated) to the first ``num_blocks`` blocks,
    the first chained to ``seed``; returns it."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else seed
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block))
    return hashes


def check_ref_counts(ref_cnt: list[int], tables: dict[str, list[int]], held: Seq[int] = ()) -> None:
    """Raise ``AssertionError`` unless ``ref_cnt`` counts the block ``tables`` (no block twice
    in one) and the ``held`` references."""
    refs = Counter(held)
    for rid, table in tables.items():
        if len(set(table)) != len(table):
            raise AssertionError(f"request {rid} holds a block twice: {table}")
        refs.update(table)
    bad = [b for b, n in enumerate(ref_cnt) if refs[b] != n]
    if bad:
        raise AssertionError(f"ref counts disagree with block tables at blocks {bad}")


class BaseBlockManager:
    """The KV block pool's ref counts and each request's block table and chained hashes.
    ``get_computed_blocks`` returns opaque cached blocks; ``allocate_slots`` returns ``False``
    (the scheduler then preempts) and changes nothing when a request does not fit."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}  # request id -> its (shared) block table
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of full blocks
        self._num_hashed: dict[str, int] = {}  # request id -> blocks already registered

    num_free_blocks: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_swap_in_blocks(self, computed_blocks: Seq) -> int:
        """How many of ``computed_blocks`` an allocation would swap in."""
        return 0

    def take_swap_ops(self) -> list:
        """The host-tier copies planned since the last call, in order (clears them)."""
        return []

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(seq.request_id, [])
        return extend_block_hashes(hashes, seq.token_ids, num_full_blocks, self.block_size)

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the blocks a cache hit may cover: at most ``num_tokens - 1`` tokens (the
        last token's logits are needed) of a sequence with no blocks yet."""
        if seq.block_table or not self.enable_prefix_caching:
            return []
        return self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq = ()) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; ``computed_blocks`` (from
        ``get_computed_blocks``) are shared (or swapped in) first and count as computed."""
        table, bs, num_computed = seq.block_table, self.block_size, len(computed_blocks)
        if not num_computed and seq.num_computed_tokens + num_new_tokens <= len(table) * bs:
            return True  # the table holds them already, as in a decode step
        total = max(seq.num_computed_tokens, num_computed * bs) + num_new_tokens
        num_new = max(-(-total // bs) - len(table) - num_computed, 0)
        if num_new + self._share_cost(computed_blocks) > self.num_free_blocks:
            return False
        self._share(seq, computed_blocks)
        if computed_blocks:
            self._num_hashed[seq.request_id] = num_computed
        table.extend(self._pop_block() for _ in range(num_new))
        self._tables[seq.request_id] = table
        return True

    def _forget(self, seq: Sequence, *stores: dict) -> None:
        seq.block_table.clear()
        for store in (self._tables, self._hashes, self._num_hashed, *stores):
            store.pop(seq.request_id, None)


class BlockManager(BaseBlockManager):
    """The plain GPU-only prefix cache (``BaseBlockManager``'s contract; block ids)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest cached prefix of a sequence, as block ids. Changes nothing."""
        cached = map(self.cached.get, self._prefix_hashes(seq))
        return list(takewhile(lambda b: b is not None, cached))

    def _share_cost(self, blocks: Seq[int]) -> int:
        """Free blocks that sharing ``blocks`` takes off the free queue."""
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def _share(self, seq: Sequence, blocks: Seq[int]) -> None:
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1
            seq.block_table.append(block)

    def _pop_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        self.ref_cnt[block] = 1
        return block

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_hashed.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = hashes[i]
                self.cached.setdefault(hashes[i], block)
        self._num_hashed[seq.request_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; tail blocks become the first to be evicted."""
        for block in reversed(seq.block_table):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        self._forget(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._num_hashed = {rid: 0 for rid in self._num_hashed}

    def check_integrity(self) -> None:
        check_ref_counts(self.ref_cnt, self._tables)
        free = {b for b in range(self.num_blocks) if self.ref_cnt[b] == 0}
        if free != set(self.free_queue):
            raise AssertionError("free queue differs from the blocks with ref count 0")
        for h, block in self.cached.items():
            if self.block_hash[block] != h:
                raise AssertionError(f"hash map points at block {block} with another hash")
        seen_unhashed_end = False
        for block in reversed(self.free_queue):
            if self.block_hash[block] is None:
                seen_unhashed_end = True
            elif seen_unhashed_end:
                raise AssertionError(f"hashed free block {block} is queued before unhashed ones")
