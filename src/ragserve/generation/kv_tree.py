"""The knowledge tree's data (RAGCache over chained block hashes): document nodes, cached
blocks, passage holds, eviction policies. A node is one segment given every segment before
it; a block belongs to the node of its last token::

    tokens   [ instructions ....... | passage A ............. | passage B ..... | question ]
    blocks   [ b0      ][ b1      ][ b2      ][ b3      ][ b4      ][ b5      ][ b6 ...
    nodes    root-> I : b0 b1      A : b2 b3 (b2 ends in A)  B : b4 b5         Q : b6 ...

Each tier is closed under prefixes, so eviction is leaf-first, by node priority (PGDSF
``clock + frequency * cost / size``, or LRU).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

# cost of prefilling ``num_tokens`` tokens after ``num_context_tokens`` cached ones (seconds)
CostFn = Callable[[int, int], float]

KV_EVICTION_POLICIES = ("pgdsf", "lru")


@dataclass(eq=False)
class KVNode:
    """One document edge of the tree: ``num_tokens`` tokens at ``start``; ``priority`` (set by
    the policy on every access) never decreases; ``freq`` counts the requests that used it."""

    node_id: int
    key: int
    parent: KVNode | None
    start: int
    num_tokens: int
    cost: float
    freq: int = 0
    priority: float = 0.0
    num_blocks: int = 0  # cached blocks (any tier) owned by this node
    children: dict[int, KVNode] = field(default_factory=dict)


@dataclass(eq=False)
class CachedBlock:
    """One full block's KV by chained hash, in one or both tiers (``gpu_block`` /
    ``host_block``: ``None`` if not there); ``locked`` pins it while a swap-in is planned."""

    block_hash: int
    parent: CachedBlock | None
    node: KVNode
    depth: int
    gpu_block: int | None = None
    host_block: int | None = None
    children: set[CachedBlock] = field(default_factory=set)
    num_gpu_children: int = 0
    locked: bool = False
    is_alive: bool = True


@dataclass(eq=False)
class PassageBlocks:
    """A hold on a stored passage (shared by a step's requests): GPU ``blocks`` (token ``j`` in
    ``blocks[j // block_size]``), the first ``num_ready_blocks`` written; ``()``: unstored."""

    key: str
    token_ids: tuple[int, ...]
    blocks: tuple[int, ...] = ()
    num_ready_blocks: int = 0
    entries: list[CachedBlock] = field(default_factory=list, repr=False)

    @property
    def is_ready(self) -> bool:
        return bool(self.blocks) and self.num_ready_blocks == len(self.blocks)


class EvictionPolicy:
    """Sets node priorities (lowest evicted first): ``"lru"`` by last use; ``"pgdsf"`` (RAGCache)
    ``clock + freq * cost / size``, ``clock`` rising to each evicted priority (aging)."""

    def __init__(self, name: str) -> None:
        if name not in KV_EVICTION_POLICIES:
            raise ValueError(
                f"unknown kv_eviction_policy {name!r}; use one of {KV_EVICTION_POLICIES}"
            )
        self.name = name
        self.clock = 0.0
        self._ticks = itertools.count(1)

    def on_access(self, node: KVNode) -> None:
        node.freq += 1
        if self.name == "lru":
            node.priority = float(next(self._ticks))
        else:
            node.priority = self.clock + node.freq * node.cost / max(node.num_tokens, 1)

    def on_release(self, node: KVNode) -> None:
        """A request stopped using the node."""
        if self.name == "lru":
            node.priority = float(next(self._ticks))

    def on_evict(self, node: KVNode) -> None:
        """A block of the node was evicted."""
        if self.name == "pgdsf":
            self.clock = max(self.clock, node.priority)


class EvictionHeap:
    """Lazy min-heap of eviction candidates by ``(node priority, -depth)``: a stale entry is
    re-pushed when popped; ``is_candidate`` decides at pop time."""

    def __init__(self, is_candidate: Callable[[CachedBlock], bool]):
        self._heap: list[tuple[float, int, int, CachedBlock]] = []
        self._order = itertools.count()
        self._is_candidate = is_candidate

    def push(self, block: CachedBlock) -> None:
        key = (block.node.priority, -block.depth, next(self._order), block)
        heapq.heappush(self._heap, key)

    def pop(self) -> CachedBlock | None:
        while self._heap:
            priority, _, _, block = heapq.heappop(self._heap)
            if not block.is_alive or not self._is_candidate(block):
                continue
            if priority != block.node.priority:
                self.push(block)
                continue
            return block
        return None
