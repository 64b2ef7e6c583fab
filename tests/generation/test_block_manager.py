"""Block manager and prefix cache: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from ragserve.generation import SamplingParams
from ragserve.generation.block_manager import BlockManager
from ragserve.generation.scheduler import Scheduler
from ragserve.generation.sequence import Sequence


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def computed(bm: BlockManager, s: Sequence, num_tokens: int) -> None:
    """Pretend the model ran: ``num_tokens`` of ``s`` now have KV."""
    s.num_computed_tokens = num_tokens
    bm.cache_blocks(s)


def test_prefix_sharing_ref_counts_and_lru_eviction():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))  # blocks: [0 1 2 3][4 5 6 7][8 9 . .]
    assert bm.get_computed_blocks(a) == []
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    computed(bm, a, 10)
    assert [bm.block_hash[b] is not None for b in range(3)] == [True, True, False]

    b = seq("b", list(range(8)) + [50, 51, 52, 53])  # shares a's two full blocks
    hit = bm.get_computed_blocks(b)
    assert hit == [0, 1]
    assert bm.allocate_slots(b, 4, hit)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_cnt[:4] == [2, 2, 1, 1]
    bm.check_integrity()

    bm.free(a)  # block 2 (unhashed) goes to the front of the free queue
    assert list(bm.free_queue) == [2, 4, 5, 6, 7]
    assert bm.ref_cnt[:4] == [1, 1, 0, 1]
    computed(bm, b, 12)
    bm.free(b)  # tail first: 3, then 1, then 0 (hashed blocks, kept in the cache)
    assert list(bm.free_queue) == [2, 4, 5, 6, 7, 3, 1, 0]
    assert bm.num_used_blocks == 0
    bm.check_integrity()

    c = seq("c", list(range(8)) + [99])  # hits the free cached blocks 0 and 1
    hit = bm.get_computed_blocks(c)
    assert hit == [0, 1]
    assert bm.allocate_slots(c, 1, hit)
    assert c.block_table == [0, 1, 2]
    assert list(bm.free_queue) == [4, 5, 6, 7, 3]
    d = seq("d", list(range(100, 120)))  # 5 blocks: evicts LRU, i.e. block 3's cached hash
    assert bm.allocate_slots(d, 20)
    assert d.block_table == [4, 5, 6, 7, 3]
    assert bm.block_hash[3] is None and len(bm.cached) == 2
    e = seq("e", list(range(8)) + [50, 51, 52, 53, 54])  # b's third block was evicted
    assert bm.get_computed_blocks(e) == [0, 1]
    assert not bm.allocate_slots(e, 5, [0, 1])  # needs 2 more blocks, none free
    assert bm.ref_cnt[:2] == [1, 1] and e.block_table == []
    bm.check_integrity()
    for s in (c, d):
        bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_fully_cached_prompt_recomputes_its_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    computed(bm, a, 8)
    b = seq("b", list(range(8)))
    assert bm.get_computed_blocks(b) == [0]  # not [0, 1]: token 7 needs its logits
    assert bm.allocate_slots(b, 4, [0])
    assert b.block_table == [0, 2]
    bm.check_integrity()


def test_disabled_prefix_caching_never_shares():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq("a", [1, 2, 3])
    assert bm.allocate_slots(a, 3)
    computed(bm, a, 3)
    assert bm.cached == {} and bm.get_computed_blocks(seq("b", [1, 2, 3])) == []


def test_check_integrity_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3])
    assert bm.allocate_slots(a, 3)
    bm.ref_cnt[0] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity()


def test_scheduler_preempts_newest_and_readmits_it_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", [1, 2, 3, 4]), seq("b", [5, 6, 7, 8])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_scheduled_tokens == [4, 4]
    assert out.sample == [True, True]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    sched.update_after_step(out)
    a.append_token(9)  # a and b each need a 3rd block for their 5th token; the pool is full
    b.append_token(10)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"] and out.num_scheduled_tokens == [1]
    assert [s.request_id for s in sched.waiting] == ["b"] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert a.block_table == [0, 1, 3]  # b's tail block was evicted first
    bm.check_integrity()
    sched.update_after_step(out)
    sched.finish(a, "length")
    assert list(bm.free_queue) == [3, 2, 1, 0]
    out = sched.schedule()  # b returns: its first block [5 6] is still cached
    assert [s.request_id for s in out.seqs] == ["b"] and out.sample == [True]
    assert b.num_computed_tokens == 2 and out.num_scheduled_tokens == [3]
    assert b.block_table == [2, 3, 1]
    assert sched.prefix_cache_hit_tokens == 2
    bm.check_integrity()


def test_chunked_prefill_respects_the_token_budget():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=5)
    a, b = seq("a", list(range(7))), seq("b", list(range(10, 13)))
    sched.add(a)
    sched.add(b)
    chunks = []
    while True:
        out = sched.schedule()
        if out.is_empty or all(out.sample):
            chunks.append((out.num_scheduled_tokens, out.sample))
            break
        chunks.append((out.num_scheduled_tokens, out.sample))
        sched.update_after_step(out)
    # step 1: a's first 5; step 2: a's last 2 + b's 3
    assert chunks == [([5], [False]), ([2, 3], [True, True])]
