"""The GPU and host KV tiers under the knowledge tree (RAGCache), behind the ``BlockManager``
interface::

    GPU  [ in use (ref > 0) | cached, ref 0 (evictable, by node priority) | free ]
    host [ copies of evicted cached blocks (evictable leaves first)       | free ]

Copies are not done here: mutations append ``SwapOp``s in order, and the engine runs them
(``take_swap_ops``) before the step's forward pass.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import takewhile

from ragserve.generation.block_manager import BaseBlockManager, check_ref_counts
from ragserve.generation.config import ModelConfig
from ragserve.generation.kv_passages import PassageTierMixin
from ragserve.generation.kv_tree import CachedBlock, CostFn, EvictionHeap, EvictionPolicy, KVNode
from ragserve.generation.segments import find_segment_ends
from ragserve.generation.sequence import Sequence


@dataclass(frozen=True)
class SwapOp:
    """Copy one block: ``"out"`` GPU ``gpu_block`` -> host ``host_block``; ``"in"`` back."""

    kind: str
    gpu_block: int
    host_block: int


def _best_swap_cut(
    cost_fn: CostFn, swap_cost_fn: Callable[[int], float], bs: int, num_gpu: int, num_host: int
) -> int:
    """How many of ``num_host`` host blocks after ``num_gpu`` GPU blocks to swap in."""
    best_k, best_cost = num_host, None
    for k in range(num_host, -1, -1):
        start = (num_gpu + k) * bs
        rest = (num_host - k) * bs
        recompute = cost_fn(rest, start) - cost_fn(0, start) if rest else 0.0
        cost = swap_cost_fn(k) + recompute
        if best_cost is None or cost < best_cost:
            best_k, best_cost = k, cost
    return best_k


@dataclass(frozen=True)
class PrefillCostModel:
    """A ``CostFn``: ``fixed_s + n * (per_token_s + per_token_context_s * (c + n / 2))`` for
    ``n`` new tokens after ``c`` cached ones. Measured: ``bench/kv_cost_profile.py``."""

    per_token_s: float
    per_token_context_s: float
    fixed_s: float = 0.0

    def __call__(self, num_tokens: int, num_context_tokens: int) -> float:
        attended = num_context_tokens + num_tokens / 2
        return self.fixed_s + num_tokens * (self.per_token_s + self.per_token_context_s * attended)

    @classmethod
    def from_flops(cls, cfg: ModelConfig, seconds_per_flop: float = 1e-12) -> PrefillCostModel:
        """Costs from the model's shape (2 FLOPs per weight, 4 per attended key) at
        ``seconds_per_flop`` (the default, 1 TFLOP/s, gives relative costs only)."""
        weights = cfg.num_hidden_layers * (
            cfg.hidden_size
            * cfg.head_dim
            * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        return cls(
            per_token_s=2.0 * weights * seconds_per_flop,
            per_token_context_s=attention * seconds_per_flop,
        )


class TieredBlockManager(BaseBlockManager, PassageTierMixin):
    """Owns the GPU and host block pools, with cached blocks in the knowledge tree
    (``BaseBlockManager``'s contract); mutates ``seq.block_table`` only."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        policy: str = "pgdsf",
        cost_fn: CostFn | None = None,
        newline_counts: dict[int, int] | None = None,
        swap_cost_fn: Callable[[int], float] | None = None,
        swap_out_filter: bool = True,
    ):
        super().__init__(num_blocks, block_size)
        if num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        self.num_host_blocks = num_host_blocks
        self.policy = EvictionPolicy(policy)
        self.cost_fn = cost_fn or PrefillCostModel(1.0, 1 / 4096)  # relative, shape-free
        self.swap_cost_fn = swap_cost_fn
        self.swap_out_filter = swap_out_filter
        self.newline_counts = newline_counts or {}
        self.gpu_entry: list[CachedBlock | None] = [None] * num_blocks
        self.host_entry: list[CachedBlock | None] = [None] * num_host_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self.entries: dict[int, CachedBlock] = {}  # block hash -> cached block
        self.nodes: dict[int, KVNode] = {}  # node key -> node
        self._gpu_heap = EvictionHeap(self._is_gpu_candidate)
        self._host_heap = EvictionHeap(self._is_host_candidate)
        self._num_evictable = 0
        self._node_ids = 0
        self._ops: list[SwapOp] = []
        self._stopped: set[str] = set()  # requests whose blocks no longer chain to the cache
        self._node_keys: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (ends, keys)
        self._counted: dict[str, set[int]] = {}  # rid -> ids of nodes it has accessed
        self._skipped: dict[str, int] = {}  # rid -> host hit blocks it would recompute
        # NOTE: the waiting queue is scanned every step (cache-aware admission), same shapes
        self._best_swap_cut = functools.lru_cache(maxsize=4096)(_best_swap_cut)
        self.num_gpu_hit_tokens = 0
        self.num_host_hit_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_evicted_gpu_blocks = 0
        self.num_evicted_host_blocks = 0
        self.num_swap_skipped_blocks = 0
        self.num_swap_out_skipped_blocks = 0
        self._init_passages()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free plus cached-and-unused (evictable)."""
        return len(self.free_blocks) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for e in self.entries.values() if e.gpu_block is not None)

    @property
    def num_host_used_blocks(self) -> int:
        return self.num_host_blocks - len(self.free_host_blocks)

    def take_swap_ops(self) -> list[SwapOp]:
        ops, self._ops = self._ops, []
        return ops

    def get_computed_blocks(self, seq: Sequence) -> list[CachedBlock]:
        """The longest cached prefix (GPU or host) of a sequence. Changes nothing."""
        return self._cheaper_to_swap(seq, self._cached_prefix(self._prefix_hashes(seq)))

    def _cached_prefix(self, hashes: list[int]) -> list[CachedBlock]:
        return list(takewhile(lambda e: e is not None, map(self.entries.get, hashes)))

    def _cheaper_to_swap(self, seq: Sequence, hit: list[CachedBlock]) -> list[CachedBlock]:
        """``hit`` cut where swapping in its host part stops paying: keeping k host blocks
        costs k swaps plus recomputing the rest; the cheapest k wins (ties: more swapped)."""
        num_gpu = next((i for i, e in enumerate(hit) if e.gpu_block is None), len(hit))
        if self.swap_cost_fn is None or num_gpu == len(hit):
            return hit
        num_host = len(hit) - num_gpu
        models = (self.cost_fn, self.swap_cost_fn, self.block_size)
        best_k = self._best_swap_cut(*models, num_gpu, num_host)
        self._skipped[seq.request_id] = num_host - best_k  # counted when admitted
        return hit[: num_gpu + best_k]

    def num_swap_in_blocks(self, computed_blocks: Seq[CachedBlock]) -> int:
        return sum(1 for e in computed_blocks if e.gpu_block is None)

    def _share_cost(self, entries: Seq[CachedBlock]) -> int:
        """Allocatable blocks that sharing ``entries`` uses: host ones swapped in, unused GPU
        ones taken off the evictable pool."""
        return sum(1 for e in entries if e.gpu_block is None or self.ref_cnt[e.gpu_block] == 0)

    def _share(self, seq: Sequence, entries: Seq[CachedBlock]) -> None:
        """Share the GPU ``entries``, swap in the host ones (locked first: no swap-in evicts
        another's host copy) and count the hits."""
        admitted = not seq.block_table
        on_host = [e for e in entries if e.gpu_block is None]
        for entry in on_host:
            entry.locked = True
        for entry in entries:
            if entry.gpu_block is None:
                self._swap_in(entry)
            else:
                self._acquire(entry.gpu_block)
            seq.block_table.append(entry.gpu_block)
        if admitted:
            self.num_swap_skipped_blocks += self._skipped.pop(seq.request_id, 0)
        if entries:
            self.num_gpu_hit_tokens += (len(entries) - len(on_host)) * self.block_size
            self.num_host_hit_tokens += len(on_host) * self.block_size
            self._access(seq, {e.node.node_id: e.node for e in entries}.values())

    def _acquire(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            self._num_evictable -= 1
        self.ref_cnt[block] += 1

    def _swap_in(self, entry: CachedBlock) -> None:
        block = self._pop_block()
        entry.locked = False
        self._attach_gpu(entry, block)
        self._ops.append(SwapOp("in", block, entry.host_block))
        self.num_swapped_in_blocks += 1

    def _attach_gpu(self, entry: CachedBlock, block: int) -> None:
        entry.gpu_block = block
        self.gpu_entry[block] = entry
        if entry.parent is not None:
            entry.parent.num_gpu_children += 1

    def _pop_block(self) -> int:
        """A GPU block for new KV, ref count 1: a free one, else the evicted lowest-priority
        leaf's."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif (victim := self._gpu_heap.pop()) is not None:
            block = victim.gpu_block
            self._evict_gpu(victim)
        else:
            raise AssertionError("no evictable block although the pool count said so")
        self.ref_cnt[block] = 1
        return block

    def _evict_gpu(self, entry: CachedBlock, swap: bool = True) -> None:
        block = entry.gpu_block
        self._num_evictable -= 1
        self.num_evicted_gpu_blocks += 1
        self.policy.on_evict(entry.node)
        if swap and entry.host_block is None and self.num_host_blocks:
            host = self._pop_host_block() if self._worth_keeping(entry) else None
            if host is not None:
                entry.host_block = host
                self.host_entry[host] = entry
                self._ops.append(SwapOp("out", block, host))
                self.num_swapped_out_blocks += 1
        entry.gpu_block = None
        self.gpu_entry[block] = None
        parent = entry.parent
        if parent is not None:
            parent.num_gpu_children -= 1
            if self._is_gpu_candidate(parent):
                self._gpu_heap.push(parent)
        if entry.host_block is None:
            self._remove(entry)
        elif not entry.children:
            self._host_heap.push(entry)

    def _worth_keeping(self, entry: CachedBlock) -> bool:
        """Whether copying ``entry`` out is worth it: room on the host, or the host's
        victim ranks no higher than ``entry``'s node (always, without ``swap_out_filter``)."""
        if self.free_host_blocks or not self.swap_out_filter:
            return True
        victim = self._host_heap.pop()
        if victim is None:
            return True  # nothing to evict: ``_pop_host_block`` finds no room either
        self._host_heap.push(victim)
        if victim.node.priority > entry.node.priority:
            self.num_swap_out_skipped_blocks += 1
            return False
        return True

    def _pop_host_block(self) -> int | None:
        if self.free_host_blocks:
            return self.free_host_blocks.popleft()
        victim = self._host_heap.pop()
        if victim is None:
            return None
        host = victim.host_block
        victim.host_block = None
        self.host_entry[host] = None
        self.num_evicted_host_blocks += 1
        self._remove(victim)
        return host

    def _remove(self, entry: CachedBlock) -> None:
        """Forget a block with no copy left, and its (host-only) descendants."""
        for child in list(entry.children):
            self.host_entry[child.host_block] = None
            self.free_host_blocks.append(child.host_block)
            child.host_block = None
            self._remove(child)
        entry.is_alive = False
        del self.entries[entry.block_hash]
        node = entry.node
        node.num_blocks -= 1
        self._maybe_drop_node(node)
        parent = entry.parent
        if parent is not None:
            parent.children.discard(entry)
            if self._is_host_candidate(parent):
                self._host_heap.push(parent)

    def _is_gpu_candidate(self, entry: CachedBlock) -> bool:
        block = entry.gpu_block
        return block is not None and self.ref_cnt[block] == 0 and entry.num_gpu_children == 0

    def _is_host_candidate(self, entry: CachedBlock) -> bool:
        return (
            entry.gpu_block is None
            and entry.host_block is not None
            and not entry.children
            and not entry.locked
        )

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the tree (after a step)."""
        rid = seq.request_id
        table = seq.block_table
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(rid, 0)
        if num_full <= start or rid in self._stopped or not self.enable_prefix_caching:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            parent = self.gpu_entry[table[i - 1]] if i else None
            if i and (parent is None or parent.block_hash != hashes[i - 1]):
                self._stopped.add(rid)
                return
            entry = self.entries.get(hashes[i])
            if entry is None:
                node = self._node_for(seq, i)
                self._new_entry(hashes[i], parent, node, i, table[i])
                self._access(seq, (node,))
            elif entry.gpu_block is None:
                self._attach_gpu(entry, table[i])  # recomputed a host-only block: adopt it
            else:
                self._stopped.add(rid)  # computed twice at once: keep the first copy
                return
            self._num_hashed[rid] = i + 1

    def _new_entry(
        self, h: int, parent: CachedBlock | None, node: KVNode, depth: int, block: int
    ) -> CachedBlock:
        """A new cached block in the tree, its KV in GPU ``block``."""
        entry = self.entries[h] = CachedBlock(h, parent, node, depth)
        node.num_blocks += 1
        if parent is not None:
            parent.children.add(entry)
        self._attach_gpu(entry, block)
        return entry

    def _access(self, seq: Sequence, nodes) -> None:
        counted = self._counted.setdefault(seq.request_id, set())
        for node in nodes:
            if node.node_id not in counted:
                counted.add(node.node_id)
                self.policy.on_access(node)

    def _node_for(self, seq: Sequence, block_index: int) -> KVNode:
        """The node owning block ``block_index`` of ``seq`` (its last token's segment)."""
        ends, keys = self._segments(seq)
        last_token = (block_index + 1) * self.block_size - 1
        index = min(bisect.bisect_right(ends, last_token), len(ends) - 1)
        parent = None
        for j in range(index + 1):
            node = self.nodes.get(keys[j])
            if node is None:
                start = ends[j - 1] if j else 0
                node = self._new_node(keys[j], parent, start, ends[j] - start)
            parent = node
        return parent

    def _new_node(self, key: int, parent: KVNode | None, start: int, num_tokens: int) -> KVNode:
        self._node_ids += 1
        cost = self.cost_fn(num_tokens, start)
        node = self.nodes[key] = KVNode(self._node_ids, key, parent, start, num_tokens, cost)
        if parent is not None:
            parent.children[key] = node
        return node

    def _segments(self, seq: Sequence) -> tuple[list[int], list[int]]:
        cached = self._node_keys.get(seq.request_id)
        if cached is None:
            prompt = seq.prompt_token_ids
            ends = list(seq.segment_ends or find_segment_ends(prompt, self.newline_counts))
            keys, key, start = [], None, 0
            for end in ends:
                key = hash((key, tuple(prompt[start:end])))
                keys.append(key)
                start = end
            cached = self._node_keys[seq.request_id] = (ends, keys)
        return cached

    def _maybe_drop_node(self, node: KVNode | None) -> None:
        while node is not None and node.num_blocks == 0 and not node.children:
            del self.nodes[node.key]
            if node.parent is not None:
                del node.parent.children[node.key]
            node = node.parent

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, tail first: at zero an uncached block is freed
        and a cached one becomes evictable (its node told once per run of its blocks)."""
        released: KVNode | None = None
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            entry = self.gpu_entry[block]
            if self.ref_cnt[block]:
                continue
            if entry is None:
                self.free_blocks.appendleft(block)
                continue
            self._num_evictable += 1
            if entry.node is not released:
                released = entry.node
                self.policy.on_release(released)
            if entry.num_gpu_children == 0:
                self._gpu_heap.push(entry)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its cached blocks become evictable, tail first."""
        self._release(seq.block_table)
        self._forget(seq, self._node_keys, self._counted, self._skipped)
        self._stopped.discard(seq.request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody uses (GPU and host; planned swap-outs are
        cancelled); blocks in use stay cached."""
        self._ops = [op for op in self._ops if op.kind == "in"]
        for entry in sorted(self.entries.values(), key=lambda e: e.depth):
            if entry.is_alive and entry.host_block is not None and not entry.locked:
                self.host_entry[entry.host_block] = None
                self.free_host_blocks.append(entry.host_block)
                entry.host_block = None
                if entry.gpu_block is None:
                    self._remove(entry)
        while (victim := self._gpu_heap.pop()) is not None:
            block = victim.gpu_block
            self._evict_gpu(victim, swap=False)
            self.free_blocks.append(block)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first invariant of the ref counts, pools, tree
        or nodes that does not hold (tests call it after every step, the engine when idle)."""
        holds = [e.gpu_block for hs in self._passage_holds.values() for h in hs for e in h.entries]
        check_ref_counts(self.ref_cnt, self._tables, holds)
        _check_gpu_pool(self)
        _check_host_pool(self)
        _check_tree(self)


def _check_gpu_pool(bm: TieredBlockManager) -> None:
    free_set = set(bm.free_blocks)  # NOTE: membership below must not scan the free list (O(n^2))
    if len(free_set) != len(bm.free_blocks):
        raise AssertionError("a GPU block is free twice")
    for block in bm.free_blocks:
        if bm.ref_cnt[block] or bm.gpu_entry[block] is not None:
            raise AssertionError(f"free GPU block {block} is in use or cached")
    evictable = 0
    for block in range(bm.num_blocks):
        entry = bm.gpu_entry[block]
        if entry is not None and entry.gpu_block != block:
            raise AssertionError(f"GPU block {block} maps to a cached block stored elsewhere")
        if bm.ref_cnt[block] == 0 and block not in free_set:
            if entry is None:
                raise AssertionError(f"GPU block {block} is neither used, cached nor free")
            evictable += 1
    if evictable != bm._num_evictable:
        raise AssertionError(f"{evictable} evictable GPU blocks, counter says {bm._num_evictable}")


def _check_host_pool(bm: TieredBlockManager) -> None:
    free = set(bm.free_host_blocks)
    if len(free) != len(bm.free_host_blocks):
        raise AssertionError("a host block is free twice")
    for host, entry in enumerate(bm.host_entry):
        if (entry is None) != (host in free):
            raise AssertionError(f"host block {host} is both free and cached, or neither")
        if entry is not None and entry.host_block != host:
            raise AssertionError(f"host block {host} maps to a cached block stored elsewhere")


def _check_tree(bm: TieredBlockManager) -> None:
    gpu_children: Counter[int] = Counter()
    node_blocks: Counter[int] = Counter()
    for h, entry in bm.entries.items():
        if entry.block_hash != h or not entry.is_alive:
            raise AssertionError(f"hash map holds a dead or misfiled block {h}")
        if entry.gpu_block is None and entry.host_block is None:
            raise AssertionError(f"cached block {h} has no copy in any tier")
        if entry.locked:
            raise AssertionError(f"cached block {h} is still locked")
        parent = entry.parent
        if parent is not None:
            if bm.entries.get(parent.block_hash) is not parent or entry not in parent.children:
                raise AssertionError(f"cached block {h} hangs under a block not in the tree")
            if entry.gpu_block is not None:
                if parent.gpu_block is None:
                    raise AssertionError(f"cached block {h} is on the GPU but its parent is not")
                if bm.ref_cnt[entry.gpu_block] > bm.ref_cnt[parent.gpu_block]:
                    raise AssertionError(f"cached block {h} is used more than its parent")
                gpu_children[id(parent)] += 1
        elif entry.depth != 0:
            raise AssertionError(f"cached block {h} at depth {entry.depth} has no parent")
        if bm.nodes.get(entry.node.key) is not entry.node:
            raise AssertionError(f"cached block {h} belongs to a node not in the tree")
        node_blocks[entry.node.node_id] += 1
    for entry in bm.entries.values():
        if entry.num_gpu_children != gpu_children[id(entry)]:
            raise AssertionError(f"cached block {entry.block_hash}: wrong GPU child count")
    for key, node in bm.nodes.items():
        if node.key != key or node.num_blocks != node_blocks[node.node_id]:
            raise AssertionError(f"node {node.node_id} counts {node.num_blocks} blocks wrongly")
        if node.num_blocks == 0 and not node.children:
            raise AssertionError(f"node {node.node_id} is empty but still in the tree")
        if node.parent is not None and node.parent.children.get(key) is not node:
            raise AssertionError(f"node {node.node_id} is missing from its parent's children")
