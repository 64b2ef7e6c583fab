"""Host tier copies: swapped-out KV comes back byte-identical; cache-aware admission."""

from __future__ import annotations

import pytest
import torch

from ragserve.generation import SamplingParams
from ragserve.generation.block_manager import hash_block_tokens
from ragserve.generation.kv_cache_manager import SwapOp, TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache, _contiguous_runs, _outs_first
from ragserve.generation.scheduler import Scheduler
from ragserve.generation.sequence import Sequence


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_swapped_kv_comes_back_byte_identical(device):
    torch.manual_seed(0)
    gpu = torch.randn(2, 3, 6, 4, 2, 8, dtype=torch.bfloat16).to(device)  # [2, L, blocks, ...]
    original = gpu.clone()
    host = HostKVCache(gpu, num_host_blocks=3)
    assert host.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    # slot 2 is written twice in one run: the later copy wins, in order
    host.run([SwapOp("out", 1, 0), SwapOp("out", 4, 2), SwapOp("out", 5, 2), SwapOp("out", 3, 1)])
    gpu.zero_()
    host.run([SwapOp("in", 0, 0), SwapOp("in", 2, 2), SwapOp("in", 5, 1)])
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(gpu[:, :, 0], original[:, :, 1])
    assert torch.equal(gpu[:, :, 2], original[:, :, 5])
    assert torch.equal(gpu[:, :, 5], original[:, :, 3])
    assert torch.count_nonzero(gpu[:, :, [1, 3, 4]]) == 0
    # a mixed run keeps its order: out then in through the same slot
    host.run([SwapOp("out", 0, 1), SwapOp("in", 4, 1)])
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(gpu[:, :, 4], original[:, :, 1])


def test_host_tier_needs_a_block():
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostKVCache(torch.zeros(2, 1, 2, 4, 1, 2), 0)


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=2))


def _cached_manager() -> TieredBlockManager:
    """A manager whose cache holds the prompt ``range(12)`` (3 full blocks of 4)."""
    bm = TieredBlockManager(32, 4)
    warm = _seq("warm", list(range(13)))
    assert bm.allocate_slots(warm, 13)
    warm.num_computed_tokens = 13
    bm.cache_blocks(warm)
    bm.free(warm)
    return bm


@pytest.mark.parametrize("window", [None, 0, 1, 8])
def test_cache_aware_admission_with_a_fairness_window(window):
    bm = _cached_manager()
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, fairness_window=window)
    cold = _seq("cold", list(range(100, 113)))
    hot1, hot2 = _seq("hot1", list(range(12)) + [50]), _seq("hot2", list(range(12)) + [60])
    for s in (cold, hot1, hot2):
        sched.add(s)
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        (seq,) = out.seqs
        order.append(seq.request_id)
        sched.update_after_step(out)
        sched.finish(seq, "length")
        bm.check_integrity()
    expected = {
        None: ["cold", "hot1", "hot2"],  # first come, first served
        0: ["cold", "hot1", "hot2"],  # a window of 0 passes nobody over
        1: ["hot1", "cold", "hot2"],  # cold is passed over once, then goes first
        8: ["hot1", "hot2", "cold"],
    }[window]
    assert order == expected
    assert bm.num_gpu_hit_tokens == 24


def test_cache_aware_admission_ranks_once_per_step():
    bm = _cached_manager()
    lookups = []
    real = bm.get_computed_blocks
    bm.get_computed_blocks = lambda seq: lookups.append(seq.request_id) or real(seq)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512, fairness_window=8)
    cold = [_seq(f"cold{i}", list(range(100 * (i + 2), 100 * (i + 2) + 13))) for i in range(3)]
    hot = [_seq(f"hot{i}", list(range(12)) + [50 + i]) for i in range(3)]
    for s in (*cold, *hot):
        sched.add(s)
    out = sched.schedule()
    # hot ones first (largest cached share), then the cold ones in arrival order
    assert [s.request_id for s in out.seqs] == ["hot0", "hot1", "hot2", "cold0", "cold1", "cold2"]
    assert [s.num_computed_tokens for s in out.seqs] == [12] * 3 + [0] * 3
    # 6 shares measured once, plus the chosen one afresh per admission: 12 (before: 21)
    assert len(lookups) == 12
    bm.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(host_kv_cache_bytes=-1), "host_kv_cache_bytes"),
        (dict(host_kv_cache_bytes=1024, enable_knowledge_tree=False), "host_kv_cache_bytes"),
        (dict(host_kv_cache_bytes=1024, enable_prefix_caching=False), "host_kv_cache_bytes"),
        (dict(kv_eviction_policy="fifo"), "kv_eviction_policy"),
        (dict(cache_aware_fairness_window=-1), "cache_aware_fairness_window"),
    ],
)
def test_kv_config_errors_name_the_field(kwargs, field):
    from ragserve.generation.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapped_swap_ins_are_waited_for_per_block(device):
    torch.manual_seed(0)
    gpu = torch.randn(2, 2, 6, 4, 1, 8).to(device)
    original = gpu.clone()
    host = HostKVCache(gpu, num_host_blocks=4, overlap=True)
    host.run([SwapOp("out", 1, 0), SwapOp("out", 2, 1)])
    host.synchronize()  # CPU: the thread ran the swap-outs too
    gpu[:, :, [3, 4]] = 0
    host.run([SwapOp("in", 3, 0), SwapOp("in", 4, 1)])
    assert host.num_pending_blocks <= 2
    host.wait_for([0, 3])  # a step reading blocks 0 and 3 waits for block 3's copy only
    assert 4 in host._pending and 3 not in host._pending
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    assert torch.equal(gpu[:, :, 3], original[:, :, 1])
    host.synchronize()
    assert torch.equal(gpu[:, :, 4], original[:, :, 2])
    assert host.num_pending_blocks == 0 and not host._pending


def _swap_engine(path, host_blocks=32, **kw):
    from oracle_cases import pool_bytes

    from ragserve.generation import LLMEngine

    return LLMEngine(
        path,
        device="cpu",
        max_model_len=128,
        kv_cache_bytes=pool_bytes(path, 16, 16),
        host_kv_cache_bytes=pool_bytes(path, host_blocks, 16),
        enable_cache_aware_scheduling=False,
        **kw,
    )


def _deferral_run(engine) -> list[list[int]]:
    """A document prefix is cached, pushed to the host by other prompts, then hit while a
    long request decodes: its swap-in can overlap that request's steps."""
    import random

    rng = random.Random(3)
    doc = [rng.randrange(100, 40000) for _ in range(64)]
    fillers = [[rng.randrange(100, 40000) for _ in range(90)] for _ in range(3)]
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    outputs = [engine.generate([doc + [7, 8, 9]], short)[0].token_ids]
    for filler in fillers:
        outputs.append(engine.generate([filler], short)[0].token_ids)
    engine.add_request("long", fillers[0][:40], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()  # the long request is running (prefilled)
    engine.add_request("hit", doc + [11, 12, 13], short)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        engine.check_integrity()
    return outputs + [final["long"], final["hit"]]


def test_a_host_hit_loads_during_another_requests_step(tiny_models):
    expected = _deferral_run(_swap_engine(tiny_models["llama"], 0, enable_prefix_caching=False))
    for overlap in (True, False):
        engine = _swap_engine(tiny_models["llama"], overlap_swap_in=overlap)
        assert _deferral_run(engine) == expected
        stats = engine.stats()
        assert stats["num_host_hit_tokens"] == 64  # the document's 4 blocks came back
        assert stats["num_deferred_swap_ins"] == (1 if overlap else 0)


def test_set_kv_reuse_switches_hits_and_empties_the_cache(tiny_models):
    engine = _swap_engine(tiny_models["llama"])
    prompt = list(range(100, 180))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    (first,) = engine.generate([prompt], params)
    engine.set_kv_reuse(False)
    assert engine.block_manager.num_cached_blocks == 0 and engine.scheduler.fairness_window is None
    for _ in range(2):
        assert engine.generate([prompt], params)[0].token_ids == first.token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    engine.set_kv_reuse(True)
    assert engine.scheduler.fairness_window is None  # this engine has cache-aware admission off
    for _ in range(2):
        assert engine.generate([prompt], params)[0].token_ids == first.token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] == 64  # the second run hit 4 blocks
    engine.add_request("busy", prompt, params)
    with pytest.raises(RuntimeError, match="idle"):
        engine.set_kv_reuse(False)
    with pytest.raises(ValueError, match="enabled"):
        engine.set_kv_reuse(1)


def test_cheaper_to_swap_keeps_the_best_prefix_of_host_blocks():
    bm = TieredBlockManager(4, 4, num_host_blocks=8, cost_fn=lambda n, c: float(n))
    warm = _seq("warm", list(range(13)))  # 3 full blocks get cached
    assert bm.allocate_slots(warm, 13)
    warm.num_computed_tokens = 13
    bm.cache_blocks(warm)
    bm.free(warm)
    other = _seq("other", list(range(500, 516)))
    assert bm.allocate_slots(other, 16)  # takes every GPU block: the 3 cached go to the host
    bm.free(other)
    probe = _seq("probe", list(range(12)) + [7])
    assert [e.gpu_block for e in bm.get_computed_blocks(probe)] == [None] * 3
    bm.swap_cost_fn = lambda n: 2.0 * n  # swap 2 per block < recompute 4 per block
    assert len(bm.get_computed_blocks(probe)) == 3
    calls = []

    def expensive(n: int) -> float:  # now recomputing is cheaper: nothing is swapped
        calls.append(n)
        return 5.0 * n

    bm.swap_cost_fn = expensive
    assert bm.get_computed_blocks(probe) == []
    assert sorted(calls) == [0, 1, 2, 3]
    # the waiting queue is scanned every step: the same shape of hit reuses its cut
    assert bm.get_computed_blocks(probe) == [] and len(calls) == 4
    assert bm.allocate_slots(probe, 13)
    assert bm.num_swap_skipped_blocks == 3 and bm.num_swapped_in_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_async_swap_out_and_back_in_is_byte_identical_one_copy_per_run(device):
    torch.manual_seed(1)
    gpu = torch.randn(2, 3, 8, 4, 2, 8, dtype=torch.bfloat16).to(device)
    original = gpu.clone()
    host = HostKVCache(gpu, num_host_blocks=6, overlap=True, async_swap_out=True)
    # host slots 0, 1, 2 are one contiguous run, slot 5 a second one: two copies
    outs = [SwapOp("out", 6, 0), SwapOp("out", 2, 1), SwapOp("out", 3, 2), SwapOp("out", 0, 5)]
    host.run(outs)
    assert host.num_copies == 2
    host.wait_for([6, 2, 3, 0])  # the next step reuses these GPU blocks: their copies first
    gpu[:, :, [6, 2, 3, 0]] = 0
    host.run([SwapOp("in", 1, 0), SwapOp("in", 4, 1), SwapOp("in", 5, 2), SwapOp("in", 7, 5)])
    assert host.num_copies == 4
    host.synchronize()
    for dst, src in ((1, 6), (4, 2), (5, 3), (7, 0)):
        got, want = gpu[:, :, dst].cpu(), original[:, :, src].cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the same bytes


def test_a_gpu_block_is_not_reused_while_its_swap_out_is_in_flight():
    """The step that writes a reused block waits for the copy reading it (a held copy)."""
    import threading
    import time

    gpu = torch.arange(2 * 2 * 4 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 2, 4, 4, 1, 2)
    original = gpu[:, :, 1].clone()
    host = HostKVCache(gpu, num_host_blocks=2, async_swap_out=True)
    gate, copy_out = threading.Event(), host._copy_out

    def held_copy(run, markers):
        assert gate.wait(10), "the held copy was never released"
        copy_out(run, markers)

    host._copy_out = held_copy
    host.run([SwapOp("out", 1, 0)])  # returns at once: the copy is in flight
    assert host.num_pending_blocks == 1

    def next_step():  # reuses GPU block 1 for new KV
        host.wait_for([1, 3])
        gpu[:, :, 1] = -1.0

    step = threading.Thread(target=next_step)
    step.start()
    time.sleep(0.2)
    assert step.is_alive() and torch.equal(gpu[:, :, 1], original)  # the write waits
    gate.set()
    step.join(10)
    assert not step.is_alive()
    assert torch.equal(host.host_cache[0], original)  # the host got the block's old KV
    assert torch.all(gpu[:, :, 1] == -1.0)
    assert host.num_pending_blocks == 0


def test_sync_swap_out_is_done_on_return():
    gpu = torch.randn(2, 1, 3, 4, 1, 2)
    host = HostKVCache(gpu, num_host_blocks=2, overlap=True, async_swap_out=False)
    host.run([SwapOp("out", 2, 1)])
    assert not host._pending and torch.equal(host.host_cache[1], gpu[:, :, 2])


@pytest.mark.parametrize("swap_out_filter", [True, False])
def test_swap_out_skips_blocks_worth_less_than_the_host_victim(swap_out_filter):
    bm = TieredBlockManager(2, 4, num_host_blocks=1, policy="lru", swap_out_filter=swap_out_filter)

    def prefill(rid: str, start: int) -> int:
        seq = _seq(rid, list(range(start, start + 5)))  # one full block, one partial
        assert bm.allocate_slots(seq, 5, bm.get_computed_blocks(seq))
        seq.num_computed_tokens = 5
        bm.cache_blocks(seq)
        bm.free(seq)
        bm.check_integrity()
        return hash_block_tokens(None, list(range(start, start + 4)))

    hot = prefill("hot", 0)
    cold = prefill("cold", 10)  # evicts hot's block: the host has room, it is copied out
    assert [op.kind for op in bm.take_swap_ops()] == ["out"]
    assert bm.entries[hot].gpu_block is None and bm.entries[hot].host_block == 0
    bm.entries[hot].node.priority = 1e9  # hot is worth more than anything on the GPU
    prefill("new", 20)  # evicts cold's block with the host full (of hot)
    ops = bm.take_swap_ops()
    if swap_out_filter:
        assert ops == [] and bm.num_swap_out_skipped_blocks == 1
        assert hot in bm.entries and cold not in bm.entries  # cold dropped, hot kept
    else:
        assert [op.kind for op in ops] == ["out"] and bm.num_swap_out_skipped_blocks == 0
        assert cold in bm.entries and hot not in bm.entries  # hot evicted from the host
    assert bm.num_swapped_out_blocks == (1 if swap_out_filter else 2)


def test_a_step_waits_for_its_fused_passages_blocks_too():
    from ragserve.generation.kv_tree import PassageBlocks
    from ragserve.generation.llm_engine import _step_blocks

    seq = _seq("fused", list(range(9)))
    seq.block_table = [3, 4]
    seq.passage_blocks = [PassageBlocks("p", (1, 2), (7, 8)), PassageBlocks("q", (5,))]
    assert _step_blocks([seq, _seq("plain", [1])]) == [3, 4, 7, 8]


def test_contiguous_runs_rising_and_falling_host_slots():
    out = [SwapOp("out", 9, 3), SwapOp("out", 8, 4), SwapOp("out", 7, 5)]
    falling_in = [SwapOp("in", 1, 5), SwapOp("in", 2, 4), SwapOp("in", 3, 3)]
    runs = _contiguous_runs(out + falling_in + [SwapOp("in", 4, 2), SwapOp("in", 5, 0)])
    # a chain evicted tail first comes back prefix first over falling slots: one run, given
    # in rising slot order (slot 0 after 2 is a new run)
    assert runs == [out, [SwapOp("in", 4, 2), *reversed(falling_in)], [SwapOp("in", 5, 0)]]
    # a GPU block twice in a row of slots: two runs (its copies stay in order)
    twice = [SwapOp("in", 1, 0), SwapOp("in", 1, 1)]
    assert _contiguous_runs(twice) == [[twice[0]], [twice[1]]]
    # a falling run then a rising one of the same kind
    ops = [SwapOp("in", 1, 6), SwapOp("in", 2, 5), SwapOp("in", 3, 6), SwapOp("in", 4, 7)]
    assert _contiguous_runs(ops) == [[ops[1], ops[0]], [ops[2], ops[3]]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_falling_host_slots_swap_in_byte_identical_in_one_copy(device):
    torch.manual_seed(2)
    gpu = torch.randn(2, 3, 8, 4, 2, 8, dtype=torch.bfloat16).to(device)
    original = gpu.clone()
    host = HostKVCache(gpu, num_host_blocks=6, overlap=True, async_swap_out=True)
    # blocks 0, 1, 2 of a chain evicted tail first: slots 0, 1, 2 hold blocks 2, 1, 0
    host.run([SwapOp("out", 2, 0), SwapOp("out", 1, 1), SwapOp("out", 0, 2)])
    host.wait_for([0, 1, 2])
    gpu[:, :, [0, 1, 2]] = 0
    # swapped back in prefix first (slots 2, 1, 0) into GPU blocks 5, 6, 7: one copy
    host.run([SwapOp("in", 5, 2), SwapOp("in", 6, 1), SwapOp("in", 7, 0)])
    assert host.num_copies == 2
    host.synchronize()
    for dst, src in ((5, 0), (6, 1), (7, 2)):
        got, want = gpu[:, :, dst].cpu(), original[:, :, src].cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_outs_first_only_where_no_copy_changes():
    # a full pool: every swap-in evicts a victim first, so outs and ins alternate
    ops = [SwapOp("out", 3, 0), SwapOp("in", 3, 9), SwapOp("out", 4, 1), SwapOp("in", 4, 8)]
    assert _outs_first(ops) == [ops[0], ops[2], ops[1], ops[3]]
    assert len(_contiguous_runs(_outs_first(ops))) == 2  # was 4
    # an out that would overwrite the host slot an earlier in reads: order kept
    clash_slot = [SwapOp("in", 1, 5), SwapOp("out", 2, 5)]
    assert _outs_first(clash_slot) == clash_slot
    # an out that reads the GPU block an earlier in writes: order kept
    clash_block = [SwapOp("in", 1, 5), SwapOp("out", 1, 6)]
    assert _outs_first(clash_block) == clash_block
