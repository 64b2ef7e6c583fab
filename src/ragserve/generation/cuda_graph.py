"""CUDA graphs for decode steps: the model's forward captured once per padded batch size
(1, 2, 4, 8, then multiples of 16) over static buffers; ``run`` replays the smallest that
fits::

    static rows   0 ......... n-1 | n ........ bs-1
                  real sequences  | padding: slot -1 (nothing stored), seq_len 0, token 0

"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ragserve.generation.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class CUDAGraphRunner:
    """Captured decode forwards keyed by padded batch size; ``forward`` (the eager model call)
    must mutate nothing but the KV caches."""

    def __init__(
        self,
        forward: Forward,
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
    ):
        self.forward = forward
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.sizes = graph_batch_sizes(max_batch)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        # NOTE: host lengths say max_seq_len so that a backend sizing its launch from them
        # (the split-KV factor) picks one valid for every context length.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_lens_cpu=(1,) * bs,
            seq_lens_cpu=(self.max_seq_len,) * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per batch size, largest first, sharing one memory pool."""
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):
            md = self._metadata(bs)
            args = (self.input_ids[:bs], self.positions[:bs], md)
            self.forward(*args)  # warm-up: compiles kernels, stores nothing (slots are -1)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch %d..%d) in %.1f s",
            len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
        )  # fmt: skip

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and metadata.num_seqs <= self.max_batch
            and metadata.is_decode_only
            and metadata.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of a decode step (valid until the next run)."""
        n = metadata.num_seqs
        bs = next(b for b in self.sizes if b >= n)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            for padded in (self.seq_lens, self.input_ids, self.positions):
                padded[n:bs].fill_(0)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
