"""Continuous batching under one rule (vLLM v1): each step every scheduled request's computed
tokens catch up with its total tokens within the token budget. Running requests go first; when
the pool is full the newest is preempted; waiting ones are admitted only if nobody was."""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from ragserve.generation.block_manager import BaseBlockManager
from ragserve.generation.kv_cache_manager import TieredBlockManager
from ragserve.generation.sequence import Sequence, SequenceStatus

LOOKAHEAD = 64  # waiting requests cache-aware admission compares


@dataclass(frozen=True)
class SchedulerOutput:
    """``num_scheduled_tokens[i]`` new tokens of ``seqs[i]`` from its ``num_computed_tokens``;
    ``sample[i]``: the chunk reaches its last token (it gets a sampled token)."""

    seqs: list[Sequence]
    num_scheduled_tokens: list[int]
    sample: list[bool]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def keep(self, predicate: Callable[[Sequence], bool]) -> SchedulerOutput:
        rows = [i for i, s in enumerate(self.seqs) if predicate(s)]
        return SchedulerOutput(
            [self.seqs[i] for i in rows],
            [self.num_scheduled_tokens[i] for i in rows],
            [self.sample[i] for i in rows],
        )


class Scheduler:
    """Owns the queues and the block manager; ``schedule`` mutates queues, block tables and
    (prefix hits) ``num_computed_tokens``, which ``update_after_step`` advances."""

    def __init__(
        self,
        block_manager: BaseBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        fairness_window: int | None = None,
        overlap_swap_in: bool = False,
        max_model_len: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_model_len = max_model_len  # a pending token at this length ends its request
        self.fairness_window = fairness_window  # None: first come, first served
        self.overlap_swap_in = overlap_swap_in
        self.num_deferred_swap_ins = 0  # admissions that loaded KV during another step
        self._num_passed: Counter[str] = Counter()  # rid -> times passed over
        self._shares: dict[str, float] = {}  # rid -> cached share, measured this step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        self._shares.clear()
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and self._ends_by_length(seq):
                i += 1  # its pending token is its last: a step for it would be discarded
                continue
            n = min(_total_tokens(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            index, hit_blocks = self._pick_waiting()
            seq = self.waiting[index]
            num_hit = len(hit_blocks) * self.block_manager.block_size
            n = min(seq.num_tokens - num_hit, budget)
            cost = n
            if seq.fusion is not None:
                # NOTE: a fused prefill runs whole but computes only its rows (the budget's
                # cost); alone in a step it may pass the budget.
                cost = seq.fusion.max_rows(seq.num_tokens)
                if cost > budget and seqs:
                    break
                n = seq.num_tokens
            swaps = self.block_manager.num_swap_in_blocks(hit_blocks)
            if not self._hold_passages(seq, n):
                break
            if not self.block_manager.allocate_slots(seq, n, hit_blocks):
                self._release_passages(seq)
                break
            del self.waiting[index]
            self._pass_over(index)
            self._num_passed.pop(seq.request_id, None)
            seq.num_computed_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            self.prefix_cache_hit_tokens += num_hit
            self.prefix_cache_query_tokens += seq.num_tokens
            self.running.append(seq)
            if swaps and seqs and self.overlap_swap_in and seq.fusion is None:
                self.num_deferred_swap_ins += 1
                continue  # its KV loads during this step; it computes from the next one
            seqs.append(seq)
            counts.append(n)
            budget -= cost
        sample = [
            s.num_computed_tokens + n == _total_tokens(s) for s, n in zip(seqs, counts, strict=True)
        ]
        return SchedulerOutput(seqs, counts, sample)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether ``seq``'s pending tokens reach ``max_tokens`` or the context end."""
        if seq.num_output_tokens + seq.num_pending_tokens >= seq.params.max_tokens:
            return True
        limit = self.max_model_len
        return limit is not None and _total_tokens(seq) >= limit

    def _pick_waiting(self) -> tuple[int, list]:
        """Index in ``waiting`` of the request to admit next (the largest cached share within
        the lookahead, measured once per step) and its cached blocks (looked up afresh)."""
        if self.fairness_window is None or len(self.waiting) == 1:
            return 0, self._computed_blocks(self.waiting[0])
        best, best_share = 0, -1.0
        for i in range(min(len(self.waiting), LOOKAHEAD)):
            seq = self.waiting[i]
            if self._num_passed[seq.request_id] >= self.fairness_window:
                best = i
                break
            share = self._shares.get(seq.request_id)
            if share is None:
                hit = len(self._computed_blocks(seq)) * self.block_manager.block_size
                share = self._shares[seq.request_id] = hit / seq.num_tokens
            if share > best_share:
                best, best_share = i, share
        return best, self._computed_blocks(self.waiting[best])

    def _computed_blocks(self, seq: Sequence) -> list:
        # NOTE: fused KV is approximate: a fused request neither reuses nor shares cached
        # blocks, so the prefix cache stays exact for everyone else.
        return [] if seq.fusion is not None else self.block_manager.get_computed_blocks(seq)

    def _hold_passages(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Hold a fused request's passages in the tiers; ``False``: its blocks do not fit."""
        bm = self.block_manager
        if seq.fusion is None or not isinstance(bm, TieredBlockManager):
            return True
        keyed = [(key, seq.token_ids[s:e]) for s, e, key in seq.fusion.spans if key is not None]
        num_blocks = -(-num_new_tokens // bm.block_size)
        handles = bm.acquire_passages(seq.request_id, keyed, num_blocks)
        seq.passage_blocks = handles
        return handles is not None

    def _release_passages(self, seq: Sequence) -> None:
        if seq.passage_blocks is not None:
            self.block_manager.release_passages(seq.request_id)
            seq.passage_blocks = None

    def _pass_over(self, index: int) -> None:
        if self.fairness_window is not None:
            self._num_passed.update(s.request_id for s in itertools.islice(self.waiting, index))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The scheduled tokens have KV now; register full blocks for reuse."""
        for seq, n in zip(output.seqs, output.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
            self._release_passages(seq)
            if seq.fusion is None:
                self.block_manager.cache_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request: free its blocks and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_passages(seq)
        self.block_manager.free(seq)
        self._num_passed.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finish_time = time.monotonic()


def _total_tokens(seq: Sequence) -> int:
    """Known tokens plus those sampled by launched steps (overlapped scheduling)."""
    return seq.num_tokens + seq.num_pending_tokens
