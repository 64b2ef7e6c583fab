"""Runs one scheduled step on the device: packs inputs, runs the model, samples.

Everything the layers need (positions, slot mapping, block tables) is built on the host
once per step and copied to the device in one go; there are no host/device syncs inside
the layer loop and exactly one after sampling. ``run_model`` is the single place a
CUDA-graph runner hooks in (same inputs, same output).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ragserve.generation import faults
from ragserve.generation.attention import (
    AttentionMetadata,
    BaseAttentionBackend,
    get_backend,
    resolve_backend,
)
from ragserve.generation.config import ModelConfig
from ragserve.generation.cuda_graph import CUDAGraphRunner
from ragserve.generation.fusion import FusionRunner
from ragserve.generation.sampler import Sampler
from ragserve.generation.scheduler import SchedulerOutput
from ragserve.generation.sequence import Sequence

LogitsHook = Callable[[list[Sequence], torch.Tensor], None]


def select_backend(name: str, device: torch.device) -> BaseAttentionBackend:
    """``name``, or for ``"auto"`` the best registered backend for the device
    (``attention.resolve_backend`` owns that choice)."""
    return get_backend(resolve_backend(name, device))


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the model, its paged KV cache and the attention backend.

    ``execute_model`` writes the scheduled tokens' keys/values into the cache and returns one
    sampled token per sequence with ``sample[i]`` set; it does not touch the sequences.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        backend: BaseAttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
    ):
        param = next(model.parameters())
        self.model = model
        self.config = cfg
        self.backend = backend
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (2, cfg.num_hidden_layers, num_blocks, block_size)
        shape += (cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(shape[1])]
        self.sampler = Sampler(self.device, seed)
        self.logits_hook: LogitsHook | None = None  # debug/test tap on last-position logits
        self.graph_runner: CUDAGraphRunner | None = None  # set by capture_cuda_graphs
        self.fusion: FusionRunner | None = None  # cache fusion, set by the engine

    def capture_cuda_graphs(self, max_batch: int, max_seq_len: int) -> None:
        """Record decode forwards for batch sizes up to ``max_batch`` (``cuda_graph.py``)."""
        self.graph_runner = CUDAGraphRunner(
            lambda ids, pos, md: self.model(ids, pos, self.kv_caches, md, self.backend),
            max_batch=max_batch,
            max_blocks_per_seq=-(-max_seq_len // self.block_size),
            max_seq_len=max_seq_len,
            device=self.device,
        )
        self.graph_runner.capture()

    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat ``input_ids``, ``positions``, the step's metadata and the rows to sample."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, logits_rows = [0], [], []
        max_blocks = max(len(s.block_table) for s in out.seqs)
        tables = np.zeros((len(out.seqs), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            tables[i, : len(table)] = table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if n == 1:  # decode: plain ints are far cheaper than numpy per sequence
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if out.sample[i]:
                logits_rows.append(query_start[-1] - 1)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=_to(np.asarray(query_start, dtype=np.int32), dev),
            seq_lens=_to(np.asarray(seq_lens, dtype=np.int32), dev),
            block_tables=_to(tables, dev),
            slot_mapping=_to(np.asarray(slots, dtype=np.int64), dev),
            query_lens_cpu=tuple(out.num_scheduled_tokens),
            seq_lens_cpu=tuple(seq_lens),
        )
        input_ids = _to(np.asarray(ids, dtype=np.int64), dev)
        positions_t = _to(np.asarray(positions, dtype=np.int64), dev)
        return input_ids, positions_t, metadata, _to(np.asarray(logits_rows, dtype=np.int64), dev)

    def run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of every scheduled token (the CUDA-graph replay point)."""
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            return self.graph_runner.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata, self.backend)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> list[int]:
        """Sampled tokens of the sequences with ``out.sample`` set, in order. A sequence with a
        fusion plan and nothing computed yet takes the fused prefill (``fusion/``) instead of
        the batched forward; the rest of the step runs batched as usual."""
        faults.check("forward", out.seqs)
        fused = [
            i
            for i, s in enumerate(out.seqs)
            if s.fusion is not None and s.num_computed_tokens == 0 and self.fusion is not None
        ]
        plain = _drop(out, fused) if fused else out
        rows: dict[int, torch.Tensor] = {}
        if not plain.is_empty:
            input_ids, positions, metadata, logits_rows = self.prepare_inputs(plain)
            hidden = self.run_model(input_ids, positions, metadata)
            sampled_ids = [id(s) for s, f in zip(plain.seqs, plain.sample, strict=True) if f]
            rows = dict(zip(sampled_ids, hidden[logits_rows], strict=True))
        for i in fused:
            rows[id(out.seqs[i])] = self._fused_prefill(out.seqs[i])
        sampled = [s for s, flag in zip(out.seqs, out.sample, strict=True) if flag]
        if not sampled:
            return []
        logits = self.model.compute_logits(torch.stack([rows[id(s)] for s in sampled]))
        if self.logits_hook is not None:
            self.logits_hook(sampled, logits)
        faults.check("sample", sampled)
        return self.sampler(logits, [s.request_id for s in sampled], [s.params for s in sampled])

    def _fused_prefill(self, seq: Sequence) -> torch.Tensor:
        """Final hidden state of the last token after a fused prefill of the whole sequence."""
        bs = self.block_size
        pos = np.arange(seq.num_tokens)
        slots = np.asarray(seq.block_table)[pos // bs] * bs + pos % bs
        return self.fusion.prefill(
            seq.token_ids,
            seq.fusion,
            self.kv_caches,
            _to(slots.astype(np.int64), self.device),
            seq.passage_blocks,
        )


def _drop(out: SchedulerOutput, indices: list[int]) -> SchedulerOutput:
    dropped = set(indices)
    keep = [i for i in range(len(out.seqs)) if i not in dropped]
    return SchedulerOutput(
        [out.seqs[i] for i in keep],
        [out.num_scheduled_tokens[i] for i in keep],
        [out.sample[i] for i in keep],
    )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
