"""``TieredBlockManager.check_integrity``: every invariant of the pools and the tree.

Called by tests after every step and by the engine when it goes idle.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragserve.generation.kv_cache_manager import TieredBlockManager


def check_tiered_integrity(bm: TieredBlockManager) -> None:
    """Raise ``AssertionError`` naming the first broken invariant."""
    _check_refs(bm)
    _check_gpu_pool(bm)
    _check_host_pool(bm)
    _check_tree(bm)


def _check_refs(bm: TieredBlockManager) -> None:
    refs = [0] * bm.num_blocks
    for rid, table in bm._tables.items():
        if len(set(table)) != len(table):
            raise AssertionError(f"request {rid} holds a block twice: {table}")
        for block in table:
            refs[block] += 1
    for handles in bm._passage_holds.values():
        for handle in handles:
            for entry in handle.entries:
                refs[entry.gpu_block] += 1
    if refs != bm.ref_cnt:
        bad = [b for b in range(bm.num_blocks) if refs[b] != bm.ref_cnt[b]]
        raise AssertionError(f"ref counts disagree with block tables at blocks {bad}")


def _check_gpu_pool(bm: TieredBlockManager) -> None:
    free = list(bm.free_blocks)
    free_set = set(free)  # NOTE: membership below must not scan the free list (O(n^2))
    if len(free_set) != len(free):
        raise AssertionError("a GPU block is free twice")
    for block in free:
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
    for host in range(bm.num_host_blocks):
        entry = bm.host_entry[host]
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
