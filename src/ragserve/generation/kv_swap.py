"""The host KV tier's memory and the block copies between it and the GPU pool.

The host pool mirrors one GPU block per slot: ``[2, layers, num_host_blocks, block_size,
kv_heads, head_dim]``, pinned on CUDA. ``run`` executes a step's ``SwapOp``s in order
(consecutive ops of one kind become one gather and one scatter). On CUDA swap-ins are issued
asynchronously on a side stream from pinned staging memory and the compute stream waits for
that stream before the step's forward, so they overlap the host-side preparation of the
step; swap-outs are blocking copies (the host slot is reused right away). On CPU both are
plain copies.
"""

from __future__ import annotations

import torch

from ragserve.generation.kv_cache_manager import SwapOp


class HostKVCache:
    """Host copies of KV blocks for a GPU cache of shape ``[2, L, num_blocks, ...]``."""

    def __init__(self, gpu_cache: torch.Tensor, num_host_blocks: int):
        if num_host_blocks < 1:
            raise ValueError("num_host_blocks must be >= 1 for a host tier")
        shape = list(gpu_cache.shape)
        shape[2] = num_host_blocks
        pin = gpu_cache.device.type == "cuda"
        self.gpu_cache = gpu_cache
        self.host_cache = torch.zeros(shape, dtype=gpu_cache.dtype, pin_memory=pin)
        self.num_host_blocks = num_host_blocks
        self._stream = torch.cuda.Stream(gpu_cache.device) if pin else None

    @property
    def bytes_per_block(self) -> int:
        return self.host_cache[:, :, 0].numel() * self.host_cache.element_size()

    def run(self, ops: list[SwapOp]) -> None:
        """Copy the blocks of ``ops`` in order; on CUDA the current stream then waits for them."""
        if not ops:
            return
        if self._stream is None:
            self._run_groups(ops)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.gpu_cache.device))
        with torch.cuda.stream(self._stream):
            self._run_groups(ops)
        torch.cuda.current_stream(self.gpu_cache.device).wait_stream(self._stream)

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


def _index(ids: list[int], device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
