"""The host KV tier's memory (block-major, pinned on CUDA) and its copies with the GPU pool:
``run`` executes a step's ``SwapOp``s, one copy per contiguous run of host slots. Asynchronous
copies go on a side CUDA stream (CPU: one thread) and mark their GPU blocks, which
``wait_for(blocks)`` makes a step wait for."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ragserve.generation.kv_cache_manager import SwapOp
from ragserve.generation.sampler import to_device


class HostKVCache:
    """Host copies of KV blocks for a GPU cache of shape ``[2, L, num_blocks, ...]``."""

    def __init__(
        self,
        gpu_cache: torch.Tensor,
        num_host_blocks: int,
        *,
        overlap: bool = False,
        async_swap_out: bool = False,
    ):
        if num_host_blocks < 1:
            raise ValueError("num_host_blocks must be >= 1 for a host tier")
        shape = list(gpu_cache.shape)
        block_shape = shape[:2] + shape[3:]
        pin = gpu_cache.device.type == "cuda"
        self.gpu_cache = gpu_cache
        self.host_cache = torch.zeros(
            [num_host_blocks, *block_shape], dtype=gpu_cache.dtype, pin_memory=pin
        )
        self.num_host_blocks = num_host_blocks
        self.overlap = overlap
        self.async_swap_out = async_swap_out
        self.num_copies = 0  # copies issued (one per contiguous run of ops)
        self._stream = torch.cuda.Stream(gpu_cache.device) if pin else None
        threaded = not pin and (overlap or async_swap_out)
        self._thread = ThreadPoolExecutor(1, "kv-swap") if threaded else None
        self._pending: dict[int, torch.cuda.Event | Future] = {}  # GPU block -> marker

    @property
    def bytes_per_block(self) -> int:
        return self.host_cache[0].numel() * self.host_cache.element_size()

    def run(self, ops: list[SwapOp]) -> None:
        """Copy the blocks of ``ops`` in order; asynchronous ones (``async_swap_out`` outs,
        ``overlap`` ins) stay pending until ``wait_for`` / ``synchronize``."""
        if not ops:
            return
        has_in = any(op.kind == "in" for op in ops)
        has_out = len(ops) > sum(1 for op in ops if op.kind == "in")
        blocking = (has_in and not self.overlap) or (has_out and not self.async_swap_out)
        runs = _contiguous_runs(_outs_first(ops))
        self.num_copies += len(runs)
        if self._thread is not None:
            future = self._thread.submit(self._run_groups, runs, None)
            if blocking:
                future.result()
                return
            for op in ops:
                self._pending[op.gpu_block] = future
            return
        if self._stream is None:
            self._run_groups(runs, None)
            return
        compute = torch.cuda.current_stream(self.gpu_cache.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._run_groups(runs, self._pending)
        if not blocking:
            return
        for op in ops:
            self._pending.pop(op.gpu_block, None)
        compute.wait_stream(self._stream)
        if has_out and not self.async_swap_out:
            self._stream.synchronize()  # the host copies exist when this returns

    def wait_for(self, blocks: Iterable[int]) -> None:
        """The step using ``blocks`` waits for their pending copies (CUDA: the stream)."""
        if not self._pending:
            return
        popped = (self._pending.pop(block, None) for block in blocks)
        markers = {id(m): m for m in popped if m is not None}  # each once, first use first
        for marker in markers.values():
            if isinstance(marker, Future):
                marker.result()
            else:
                torch.cuda.current_stream(self.gpu_cache.device).wait_event(marker)
        if len(self._pending) > 4 * self.num_host_blocks:  # forget finished markers
            self._pending = {b: m for b, m in self._pending.items() if not _done(m)}

    def synchronize(self) -> None:
        """Wait (host-side) for every pending copy."""
        for marker in {id(m): m for m in self._pending.values()}.values():
            if isinstance(marker, Future):
                marker.result()
        if self._stream is not None:
            self._stream.synchronize()
        self._pending.clear()

    @property
    def num_pending_blocks(self) -> int:
        return sum(1 for m in self._pending.values() if not _done(m))

    def _run_groups(self, runs: list[list[SwapOp]], markers: dict | None) -> None:
        for run in runs:
            if run[0].kind == "out":
                self._copy_out(run, markers)
            else:
                self._copy_in(run, markers)

    def _copy_out(self, run: list[SwapOp], markers: dict | None) -> None:
        first = run[0].host_block
        gpu_ids = to_device([op.gpu_block for op in run], self.gpu_cache.device, torch.long)
        staged = self.gpu_cache[:, :, gpu_ids].movedim(2, 0)
        if self._stream is None:
            self.host_cache[first : first + len(run)] = staged
            return
        # The gather reads the pool now (on the side stream) and the blocks' marker is set
        # right after it: the transfer reads only the staging copy, whose memory the caching
        # allocator keeps for this stream's later work.
        staged = staged.contiguous()
        self._mark(run, markers)
        self.host_cache[first : first + len(run)].copy_(staged, non_blocking=True)

    def _copy_in(self, run: list[SwapOp], markers: dict | None) -> None:
        first = run[0].host_block
        gpu_ids = to_device([op.gpu_block for op in run], self.gpu_cache.device, torch.long)
        src = self.host_cache[first : first + len(run)]
        if self._stream is not None:
            src = src.to(self.gpu_cache.device, non_blocking=True)  # pinned and contiguous
        self.gpu_cache[:, :, gpu_ids] = src.movedim(0, 2)
        self._mark(run, markers)

    def _mark(self, run: list[SwapOp], markers: dict | None) -> None:
        if markers is None:
            return
        event = torch.cuda.Event()
        event.record(self._stream)
        for op in run:
            markers[op.gpu_block] = event


def _outs_first(ops: list[SwapOp]) -> list[SwapOp]:
    """``ops`` with swap-outs before swap-ins (orders kept) where no copy's data changes, else
    ``ops``. NOTE: with a full GPU pool ops alternate out, in, ...: grouped, they copy in runs."""
    read_slots: set[int] = set()
    written_blocks: set[int] = set()
    for op in ops:
        if op.kind == "in":
            read_slots.add(op.host_block)
            written_blocks.add(op.gpu_block)
        elif op.host_block in read_slots or op.gpu_block in written_blocks:
            return ops
    return [op for op in ops if op.kind == "out"] + [op for op in ops if op.kind == "in"]


def _contiguous_runs(ops: list[SwapOp]) -> list[list[SwapOp]]:
    """``ops`` cut into maximal runs of one kind over consecutive host slots (rising or falling:
    a chain evicted tail first swaps back in falling slots), each sorted; GPU blocks distinct."""
    runs: list[list[SwapOp]] = []
    blocks: set[int] = set()  # the last run's GPU blocks
    for op in ops:
        run = runs[-1] if runs else []
        step = op.host_block - run[-1].host_block if run and run[-1].kind == op.kind else 0
        direction = run[1].host_block - run[0].host_block if len(run) > 1 else step
        if step in (1, -1) and step == direction and op.gpu_block not in blocks:
            run.append(op)
        else:
            runs.append([op])
            blocks.clear()
        blocks.add(op.gpu_block)
    return [sorted(run, key=lambda op: op.host_block) for run in runs]


def _done(marker: torch.cuda.Event | Future) -> bool:
    return marker.done() if isinstance(marker, Future) else marker.query()
