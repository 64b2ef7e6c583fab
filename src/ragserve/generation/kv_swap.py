"""The host KV tier's memory and the block copies between it and the GPU pool.

The host pool mirrors one GPU block per slot: ``[2, layers, num_host_blocks, block_size,
kv_heads, head_dim]``, pinned on CUDA. ``run`` executes a step's ``SwapOp``s in order
(consecutive ops of one kind become one gather and one scatter).

Without ``overlap`` every copy is done when ``run`` returns (on CUDA the compute stream waits
for the side stream). With ``overlap`` (the engine's ``overlap_swap_in``) swap-ins are only
issued: on CUDA asynchronously on a side stream from pinned staging memory, on CPU by one
background thread (all ops then run there, in order); each copied GPU block gets a pending
marker (a CUDA event, a future). ``wait_for(blocks)`` makes the step's forward wait for the
markers of the blocks it reads or writes and no others, so a request admitted with host hits
loads while the current step runs (the scheduler defers it by one step). Swap-outs on CUDA
stay blocking (the host slot may be reused by the next op); on the CPU thread they are
ordered before any later op and marked like swap-ins (the GPU block is reused right away).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ragserve.generation.kv_cache_manager import SwapOp


class HostKVCache:
    """Host copies of KV blocks for a GPU cache of shape ``[2, L, num_blocks, ...]``."""

    def __init__(self, gpu_cache: torch.Tensor, num_host_blocks: int, *, overlap: bool = False):
        if num_host_blocks < 1:
            raise ValueError("num_host_blocks must be >= 1 for a host tier")
        shape = list(gpu_cache.shape)
        shape[2] = num_host_blocks
        pin = gpu_cache.device.type == "cuda"
        self.gpu_cache = gpu_cache
        self.host_cache = torch.zeros(shape, dtype=gpu_cache.dtype, pin_memory=pin)
        self.num_host_blocks = num_host_blocks
        self._stream = torch.cuda.Stream(gpu_cache.device) if pin else None
        self.overlap = overlap
        self._thread = ThreadPoolExecutor(1, "kv-swap") if overlap and not pin else None
        self._pending: dict[int, torch.cuda.Event | Future] = {}  # GPU block -> marker

    @property
    def bytes_per_block(self) -> int:
        return self.host_cache[:, :, 0].numel() * self.host_cache.element_size()

    def run(self, ops: list[SwapOp]) -> None:
        """Copy the blocks of ``ops`` in order: done on return without ``overlap``; with it
        swap-ins (CPU: all ops) are pending until ``wait_for`` / ``synchronize``."""
        if not ops:
            return
        if self._thread is not None:
            future = self._thread.submit(self._run_groups, ops)
            for op in ops:
                self._pending[op.gpu_block] = future
            return
        if self._stream is None:
            self._run_groups(ops)
            return
        compute = torch.cuda.current_stream(self.gpu_cache.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._run_groups(ops)
            if self.overlap:
                event = torch.cuda.Event()
                event.record(self._stream)
                for op in ops:
                    if op.kind == "in":
                        self._pending[op.gpu_block] = event
        if not self.overlap:
            compute.wait_stream(self._stream)

    def wait_for(self, blocks: Iterable[int]) -> None:
        """Make the step that uses ``blocks`` (GPU block ids) wait for their pending copies:
        on CUDA the current stream waits (the host does not), on CPU the host waits."""
        if not self._pending:
            return
        markers: list[torch.cuda.Event | Future] = []
        for block in blocks:
            marker = self._pending.pop(block, None)
            if marker is not None and not any(marker is m for m in markers):
                markers.append(marker)
        for marker in markers:
            if isinstance(marker, Future):
                marker.result()
            else:
                torch.cuda.current_stream(self.gpu_cache.device).wait_event(marker)
        if len(self._pending) > 4 * self.num_host_blocks:  # forget finished markers
            self._pending = {b: m for b, m in self._pending.items() if not _done(m)}

    def synchronize(self) -> None:
        """Wait for every pending copy (host-side): for readers outside the step loop."""
        for marker in {id(m): m for m in self._pending.values()}.values():
            if isinstance(marker, Future):
                marker.result()
            else:
                marker.synchronize()
        self._pending.clear()

    @property
    def num_pending_blocks(self) -> int:
        """GPU blocks whose copies may still be in flight."""
        return sum(1 for m in self._pending.values() if not _done(m))

    def _run_groups(self, ops: list[SwapOp]) -> None:
        start = 0
        for end in range(1, len(ops) + 1):
            if end == len(ops) or ops[end].kind != ops[start].kind:
                self._copy(ops[start].kind, ops[start:end])
                start = end

    def _copy(self, kind: str, ops: list[SwapOp]) -> None:
        gpu_ids = _index([op.gpu_block for op in ops], self.gpu_cache.device)
        host_ids = [op.host_block for op in ops]
        if kind == "out":
            # NOTE: a blocking device-to-host copy: the host pool is written right after it,
            # and a later op of this run may read or overwrite the same slot.
            if len(set(host_ids)) != len(host_ids):
                for op in ops:
                    self.host_cache[:, :, op.host_block] = self.gpu_cache[:, :, op.gpu_block].cpu()
                return
            self.host_cache[:, :, _index(host_ids, "cpu")] = self.gpu_cache[:, :, gpu_ids].cpu()
            return
        src = self.host_cache[:, :, _index(host_ids, "cpu")]
        if self._stream is not None:
            src = src.pin_memory()
        self.gpu_cache[:, :, gpu_ids] = src.to(self.gpu_cache.device, non_blocking=True)


def _done(marker: torch.cuda.Event | Future) -> bool:
    return marker.done() if isinstance(marker, Future) else marker.query()


def _index(ids: list[int], device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
