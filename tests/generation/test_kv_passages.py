"""Cache fusion's passage KV in the knowledge tree's tiers: exact block ids, shared holds,
eviction and swap like tree blocks, unstored passages when they do not fit;
``check_integrity()`` after every mutation."""

from __future__ import annotations

from ragserve.generation import SamplingParams
from ragserve.generation.kv_cache_manager import SwapOp, TieredBlockManager
from ragserve.generation.sequence import Sequence

P = [10, 11, 12, 13, 14, 15]  # two blocks of 4, the last partial
Q = [20, 21, 22, 23, 24, 25, 26, 27, 28]  # three blocks


def manager(**kw) -> TieredBlockManager:
    return TieredBlockManager(block_size=4, policy="lru", **kw)


def written(*handles) -> None:
    """What the fused prefill does to a passage it computed."""
    for handle in handles:
        handle.num_ready_blocks = len(handle.blocks)


def test_store_share_hit_and_release():
    bm = manager(num_blocks=8)
    p, q, p_again = bm.acquire_passages("r1", [("p", P), ("q", Q), ("p", P)], 2)
    assert p is p_again and p.blocks == (0, 1) and q.blocks == (2, 3, 4)
    assert p.num_ready_blocks == 0 and not q.is_ready
    assert bm.ref_cnt == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.check_integrity()
    (shared,) = bm.acquire_passages("r2", [("q", Q)], 1)  # same step: shares the pending one
    assert shared is q and bm.ref_cnt[2:5] == [2, 2, 2]
    assert (bm.num_passage_misses, bm.num_passage_hits) == (2, 1)
    written(p, q)
    bm.release_passages("r1")
    bm.release_passages("r2")
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 5
    bm.check_integrity()
    (hit,) = bm.acquire_passages("r3", [("p", P)], 0)
    assert hit.blocks == (0, 1) and hit.is_ready and bm.take_swap_ops() == []
    assert bm.num_passage_hits == 2
    bm.release_passages("r3")
    (other,) = bm.acquire_passages("r4", [("p", P[:5])], 0)  # same key, other tokens: a miss
    assert other.blocks == (5, 6) and other.num_ready_blocks == 0
    written(other)
    bm.release_passages("r4")
    bm.check_integrity()


def test_passages_evicted_to_host_and_swapped_back_in():
    bm = manager(num_blocks=8, num_host_blocks=4)
    p, q = bm.acquire_passages("r1", [("p", P), ("q", Q)], 0)
    written(p, q)
    bm.release_passages("r1")
    (p,) = bm.acquire_passages("r2", [("p", P)], 0)  # p used last: q is evicted first
    bm.release_passages("r2")
    big = Sequence("big", list(range(100, 124)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(big, 24)
    assert big.block_table == [5, 6, 7, 4, 3, 2]  # free blocks, then q's leaf first
    assert bm.take_swap_ops() == [SwapOp("out", 4, 0), SwapOp("out", 3, 1), SwapOp("out", 2, 2)]
    bm.check_integrity()
    bm.free(big)
    (q,) = bm.acquire_passages("r3", [("q", Q)], 0)
    assert q.blocks == (5, 6, 7) and q.is_ready  # ready once the engine ran the swaps
    assert bm.take_swap_ops() == [SwapOp("in", 5, 2), SwapOp("in", 6, 1), SwapOp("in", 7, 0)]
    assert bm.num_passage_hits == 2 and bm.num_swapped_in_blocks == 3
    bm.release_passages("r3")
    bm.check_integrity()


def test_what_does_not_fit_is_unstored_and_unwritten_blocks_are_forgotten():
    bm = manager(num_blocks=4)
    assert bm.acquire_passages("r", [("p", P)], 5) is None  # the request itself won't fit
    assert bm.num_free_blocks == 4 and bm.num_passage_misses == 0
    p, q = bm.acquire_passages("r", [("p", P), ("q", Q)], 1)
    assert p.blocks == (0, 1) and q.blocks == () and bm.num_passage_misses == 2
    assert bm.num_free_blocks == 2
    bm.check_integrity()
    bm.release_passages("r")  # its prefill never ran: p's blocks hold nothing
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4 and not bm.nodes
    bm.check_integrity()


def test_a_stored_passage_never_matches_a_prompt_prefix():
    bm = manager(num_blocks=8)
    (p,) = bm.acquire_passages("r", [("p", P)], 0)
    written(p)
    bm.release_passages("r")
    s = Sequence("s", P + [1, 2, 3], SamplingParams(max_tokens=1))
    assert bm.get_computed_blocks(s) == []
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    bm.check_integrity()
