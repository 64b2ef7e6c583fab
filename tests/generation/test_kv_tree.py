"""Knowledge tree bookkeeping: exact node/block ids, ref counts, eviction order per policy,
swap-out once, swap-in on a hit; ``check_integrity()`` after every mutation."""

from __future__ import annotations

import pytest

from ragserve.generation import SamplingParams
from ragserve.generation.kv_cache_manager import SwapOp, TieredBlockManager
from ragserve.generation.segments import find_segment_ends
from ragserve.generation.sequence import Sequence

BLANK = 100  # a whitespace token with two newlines: ends a segment
NEWLINES = {BLANK: 2, 101: 1}
INSTR = [1, 2, 3, BLANK]  # one block, node "I"
DOC_A = [10, 11, 12, 13, 14, 15, 16, BLANK]  # two blocks, node "A"
DOC_B = [20, 21, 22, 23, 24, 25, 26, BLANK]


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def manager(**kw) -> TieredBlockManager:
    kw.setdefault("policy", "lru")
    return TieredBlockManager(block_size=4, newline_counts=NEWLINES, **kw)


def admit(bm: TieredBlockManager, s: Sequence) -> list[int]:
    """Allocate with whatever is cached, pretend the model ran the prompt, register it."""
    hit = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - 4 * len(hit), hit)
    s.num_computed_tokens = s.num_tokens
    bm.cache_blocks(s)
    bm.check_integrity()
    return [e.gpu_block for e in hit]


def chain(bm: TieredBlockManager, s: Sequence) -> list[tuple[int, int | None, int | None]]:
    """(node id, GPU block, host block) of each cached block along ``s``'s prompt."""
    return [(e.node.node_id, e.gpu_block, e.host_block) for e in bm.get_computed_blocks(s)]


def test_segments_end_after_blank_lines():
    assert find_segment_ends(INSTR + DOC_A + [7, 101, 8], NEWLINES) == [4, 12, 15]
    assert find_segment_ends([BLANK, 5, 6], NEWLINES) == [1, 3]  # a leading blank line too
    assert find_segment_ends([5, 101, 101, 6], NEWLINES) == [3, 4]  # a run of two newlines


def test_insert_hit_and_ref_counts():
    bm = manager(num_blocks=10)
    a = seq("a", INSTR + DOC_A + [30, 31, 32])  # blocks 0 (I) 1 2 (A), partial 3
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2, 3]
    b = seq("b", INSTR + DOC_A + [40, 41, 42, 43, 44])  # shares I and A, new question
    assert admit(bm, b) == [0, 1, 2]
    assert b.block_table == [0, 1, 2, 4, 5]
    assert bm.ref_cnt[:6] == [2, 2, 2, 1, 1, 1]
    assert chain(bm, seq("x", INSTR + DOC_A + [40, 41, 42, 43, 44, 9])) == [
        (1, 0, None),
        (2, 1, None),
        (2, 2, None),
        (3, 4, None),
    ]
    nodes = {n.node_id: n for n in bm.nodes.values()}
    assert sorted(nodes) == [1, 2, 3]  # I, A, b's question (a's question had no full block)
    assert (nodes[1].freq, nodes[2].freq, nodes[3].freq) == (2, 2, 1)
    assert nodes[2].parent is nodes[1] and nodes[3].parent is nodes[2]
    assert (nodes[2].start, nodes[2].num_tokens) == (4, 8)
    assert bm.num_gpu_hit_tokens == 12 and bm.num_host_hit_tokens == 0
    bm.free(a)
    assert list(bm.free_blocks)[:1] == [3]  # a's unregistered partial block is reused first
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.ref_cnt == [0] * 10
    bm.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_eviction_order_without_host_tier(policy):
    bm = manager(num_blocks=8, policy=policy)
    a = seq("a", INSTR + DOC_A + [30])  # blocks I:0, A:1,2 (+3 partial)
    b = seq("b", INSTR + DOC_B + [30])  # hits I:0; B:4,5 (+6 partial)
    admit(bm, a)
    admit(bm, b)
    again = seq("a2", INSTR + DOC_A + [31])  # A is used twice: higher PGDSF priority
    admit(bm, again)
    for s in (b, a, again):  # LRU: A released last, B before it
        bm.free(s)
    assert bm.num_free_blocks == 8 and len(bm.free_blocks) == 3
    big = seq("big", list(range(200, 216)))  # 4 blocks: 3 free, then 1 eviction
    assert bm.allocate_slots(big, 16)
    bm.check_integrity()
    # both policies evict B's tail first: LRU because B was released before A, PGDSF because
    # A's frequency is 2 (B's is 1) at the same clock and the same per-token cost
    assert big.block_table == [7, 3, 6, 5]  # free: a2's, a's, b's partial blocks
    assert chain(bm, seq("y", INSTR + DOC_B + [1])) == [(1, 0, None), (3, 4, None)]
    more = seq("more", list(range(300, 308)))  # 2 blocks: B's head, then A's tail
    assert bm.allocate_slots(more, 8)
    assert more.block_table == [4, 2]
    assert bm.num_evicted_gpu_blocks == 3 and len(bm.nodes) == 2
    bm.check_integrity()


def test_lru_and_pgdsf_disagree_on_a_frequent_but_old_document():
    def run(policy: str) -> list[int]:
        bm = manager(num_blocks=7, policy=policy)
        for rid in ("a1", "a2", "a3"):  # A used 3 times, released first
            s = seq(rid, INSTR + DOC_A + [30])
            admit(bm, s)
            bm.free(s)
        b = seq("b", INSTR + DOC_B + [30])  # B used once, released last
        admit(bm, b)
        bm.free(b)
        big = seq("big", list(range(200, 216)))
        assert bm.allocate_slots(big, 16)
        bm.check_integrity()
        return big.block_table

    # free first: b's partial block 5, then 6; then LRU evicts A (older), PGDSF B (rarer)
    assert run("lru") == [5, 6, 2, 1]
    assert run("pgdsf") == [5, 6, 4, 3]


def test_swap_out_once_and_swap_in_on_a_hit():
    bm = manager(num_blocks=5, num_host_blocks=4)
    a = seq("a", INSTR + DOC_A + [30])  # I:0 A:1,2 partial 3
    admit(bm, a)
    bm.free(a)
    big = seq("big", list(range(200, 216)))  # needs 4: free 3, 4, then evicts A's 2, 1
    assert bm.allocate_slots(big, 16)
    assert big.block_table == [3, 4, 2, 1]
    assert bm.take_swap_ops() == [SwapOp("out", 2, 0), SwapOp("out", 1, 1)]
    assert chain(bm, seq("y", INSTR + DOC_A + [1])) == [(1, 0, None), (2, None, 1), (2, None, 0)]
    bm.check_integrity()
    bm.free(big)
    a2 = seq("a2", INSTR + DOC_A + [31])  # hits I on the GPU, A on the host
    hit = bm.get_computed_blocks(a2)
    assert bm.allocate_slots(a2, 1, hit)
    # swap-ins take big's released blocks (free list [3, 4, 2, 1]), then a new block
    assert a2.block_table == [0, 3, 4, 2]
    assert bm.take_swap_ops() == [SwapOp("in", 3, 1), SwapOp("in", 4, 0)]
    assert (bm.num_gpu_hit_tokens, bm.num_host_hit_tokens) == (4, 8)
    assert chain(bm, seq("z", INSTR + DOC_A + [1])) == [(1, 0, None), (2, 3, 1), (2, 4, 0)]
    bm.check_integrity()
    bm.free(a2)
    c = seq("c", list(range(400, 420)))  # 5 blocks: evicts everything cached
    assert bm.allocate_slots(c, 20)
    ops = bm.take_swap_ops()
    assert ops == [SwapOp("out", 0, 2)]  # A already has host copies: only I is copied out
    assert bm.num_swapped_out_blocks == 3 and bm.num_swapped_in_blocks == 2
    assert chain(bm, seq("w", INSTR + DOC_A + [1])) == [(1, None, 2), (2, None, 1), (2, None, 0)]
    bm.check_integrity()


def test_full_host_tier_drops_leaves_and_their_subtrees():
    bm = manager(num_blocks=4, num_host_blocks=1)
    a = seq("a", INSTR + DOC_A + [30])  # I:0 A:1,2 partial 3
    admit(bm, a)
    bm.free(a)
    big = seq("big", list(range(200, 216)))  # evicts A's tail (to host), A's head, I
    assert bm.allocate_slots(big, 16)
    # one host slot: each evicted block pushes out the host-only leaf before it
    assert bm.take_swap_ops() == [SwapOp("out", 2, 0), SwapOp("out", 1, 0), SwapOp("out", 0, 0)]
    assert bm.num_evicted_host_blocks == 2
    assert chain(bm, seq("y", INSTR + DOC_A + [1])) == [(1, None, 0)]
    assert len(bm.entries) == 1 and sorted(n.node_id for n in bm.nodes.values()) == [1]
    bm.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = manager(num_blocks=4, num_host_blocks=4)
    a = seq("a", INSTR + DOC_A + [30])
    admit(bm, a)
    bm.free(a)
    before = (list(bm.free_blocks), bm.ref_cnt[:], bm.num_free_blocks)
    s = seq("s", INSTR + DOC_A + list(range(500, 512)))  # 3 hits + 3 new blocks > 4
    hit = bm.get_computed_blocks(s)
    assert not bm.allocate_slots(s, s.num_tokens - 12, hit)
    assert (list(bm.free_blocks), bm.ref_cnt[:], bm.num_free_blocks) == before
    assert s.block_table == [] and bm.take_swap_ops() == []
    bm.check_integrity()


def test_reset_prefix_cache_forgets_unused_blocks():
    bm = manager(num_blocks=8, num_host_blocks=2)
    a = seq("a", INSTR + DOC_A + [30])
    b = seq("b", INSTR + DOC_B + [30])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert chain(bm, seq("y", INSTR + DOC_B + [1])) == [(1, 0, None), (3, 4, None), (3, 5, None)]
    assert bm.get_computed_blocks(seq("z", INSTR + DOC_A + [1])) == [bm.entries[a_hash(bm)]]
    bm.check_integrity()


def a_hash(bm: TieredBlockManager) -> int:
    return next(e.block_hash for e in bm.entries.values() if e.depth == 0)


def test_integrity_check_catches_a_bad_ref_count():
    bm = manager(num_blocks=4)
    a = seq("a", INSTR + [5])
    admit(bm, a)
    bm.ref_cnt[0] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity()


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv_eviction_policy"):
        manager(num_blocks=4, policy="fifo")
    with pytest.raises(ValueError, match="num_host_blocks"):
        manager(num_blocks=4, num_host_blocks=-1)
