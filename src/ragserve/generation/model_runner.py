"""Runs one scheduled step on the device: packs inputs on the host (copied once a dtype), runs the
model (``run_model``: the CUDA-graph hook) and samples; ``launch_model`` leaves the tokens on
the device (``SampledTokens``) for the next launched step."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ragserve.generation.attention.base import AttentionMetadata, get_backend
from ragserve.generation.config import EngineConfig, ModelConfig
from ragserve.generation.cuda_graph import CUDAGraphRunner
from ragserve.generation.faults import check_fault
from ragserve.generation.fusion.prefill import FusionRunner
from ragserve.generation.sampler import Sampler, to_device
from ragserve.generation.scheduler import SchedulerOutput
from ragserve.generation.sequence import Sequence

LogitsHook = Callable[[list[Sequence], torch.Tensor], None]


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class SampledTokens:
    """A launched step's sampled tokens (``device``, int64; ``row_of[seq]``: its row) until
    ``tolist`` copies them to the host; ``launched_at``: when the step was queued."""

    def __init__(self, device_tokens: torch.Tensor, seqs: list[Sequence]):
        self.device = device_tokens
        self.row_of = {seq: i for i, seq in enumerate(seqs)}
        self._event: torch.cuda.Event | None = None
        if device_tokens.device.type == "cuda":
            self._host = torch.empty(len(seqs), dtype=torch.int64, pin_memory=True)
            self._host.copy_(device_tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_tokens
        self.launched_at = time.monotonic()

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class ModelRunner:
    """Owns the model, its paged KV cache and the attention backend; ``execute_model`` writes
    the step's KV and samples, never touching the sequences."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, config: EngineConfig, num_blocks: int):
        """``config``: the resolved engine config (backend, block size, seed, fusion, graphs)."""
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.backend = get_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        shape = (2, cfg.num_hidden_layers, num_blocks, config.block_size)
        shape += (cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=param.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(shape[1])]
        self.sampler = Sampler(self.device, config.seed)
        self.logits_hook: LogitsHook | None = None  # debug/test tap on last-position logits
        self.graph_runner: CUDAGraphRunner | None = None  # CUDA: replays decode steps
        self.pack_inputs = config.enable_packed_inputs
        self.fusion = FusionRunner(model, config)
        graphs = config.enable_cuda_graphs and self.device.type == "cuda"
        if graphs and self.backend.supports_cuda_graphs:
            self.graph_runner = CUDAGraphRunner(
                lambda ids, pos, md: self.model(ids, pos, self.kv_caches, md, self.backend),
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-config.max_model_len // self.block_size),
                max_seq_len=config.max_model_len,
                device=self.device,
            )
            self.graph_runner.capture()

    def prepare_inputs(
        self,
        out: SchedulerOutput,
        fused_rows: dict[int, list[int]] | None = None,
        prev: SampledTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat ``input_ids``, ``positions``, the metadata and the rows to sample; ``fused_rows``:
        seq index -> its fused rows; ``prev``: the step launched before (pending inputs)."""
        fused_rows = fused_rows or {}
        bs = self.block_size
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        pending_rows, pending_src = [], []  # flat rows whose input is a row of ``prev.device``
        max_blocks = max(len(s.block_table) for s in out.seqs)
        tables = np.zeros((len(out.seqs), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            tables[i, : len(table)] = table
            if n == 1 and i not in fused_rows:  # decode: plain ints, far cheaper than numpy
                if start == len(seq.token_ids):  # its input is still on the device
                    if prev is None or seq not in prev.row_of:
                        raise RuntimeError(f"{seq.request_id}: pending token of no launched step")
                    pending_rows.append(len(ids))
                    pending_src.append(prev.row_of[seq])
                ids.append(seq.token_ids[start] if start < len(seq.token_ids) else 0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.asarray(fused_rows[i]) if i in fused_rows else np.arange(start, end)
                ids.extend(np.asarray(seq.token_ids)[pos].tolist())
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
                n = len(pos)
            query_lens.append(n)
            seq_lens.append(end)
        query_start = [0, *itertools.accumulate(query_lens)]
        logits_rows = [query_start[i + 1] - 1 for i, flag in enumerate(out.sample) if flag]
        dev = self.device
        longs = (ids, positions, slots, logits_rows, pending_rows, pending_src)
        ints = (query_start, seq_lens, tables.ravel())
        pack = self.pack_inputs
        input_ids, positions_t, slots_t, rows_t, pend_t, src_t = _upload(longs, dev, np.int64, pack)
        starts_t, lens_t, tables_t = _upload(ints, dev, np.int32, pack)
        metadata = AttentionMetadata(
            query_start_loc=starts_t,
            seq_lens=lens_t,
            block_tables=tables_t.view(tables.shape),
            slot_mapping=slots_t,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            query_positions=positions_t if fused_rows else None,
        )
        if pending_rows:
            input_ids[pend_t] = prev.device[src_t]
        return input_ids, positions_t, metadata, rows_t

    def run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(metadata):
            return self.graph_runner.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata, self.backend)

    def execute_model(self, out: SchedulerOutput) -> list[int]:
        """Sampled tokens of the sequences with ``out.sample`` set, in order; a fused prefill's
        stored passage KV is written and its rows chosen first (``fusion/``)."""
        sampled = self.launch_model(out)
        return [] if sampled is None else sampled.tolist()

    @torch.inference_mode()
    def launch_model(
        self, out: SchedulerOutput, prev: SampledTokens | None = None
    ) -> SampledTokens | None:
        """``execute_model`` without its host sync: the tokens stay on the device (``None``:
        nothing samples); ``prev``: the step launched before, for pending inputs."""
        check_fault("forward", out.seqs)
        fused_rows: dict[int, list[int]] = {}
        todo = [(i, s) for i, s in enumerate(out.seqs) if s.fusion and not s.num_computed_tokens]
        kvs = todo and self.fusion.step_passage_kvs(
            [(s.token_ids, s.fusion, s.passage_blocks) for _, s in todo], self.kv_cache
        )  # a decode-only step skips it
        for (i, seq), kv in zip(todo, kvs, strict=True):
            fused_rows[i] = self.fusion.prepare(
                seq.token_ids, seq.fusion, self.kv_cache, seq.block_table,
                self.backend, seq.passage_blocks, kv,
            )  # fmt: skip
        input_ids, positions, metadata, logits_rows = self.prepare_inputs(out, fused_rows, prev)
        hidden = self.run_model(input_ids, positions, metadata)
        sampled = [s for s, flag in zip(out.seqs, out.sample, strict=True) if flag]
        if not sampled:
            return None
        logits = self.model.compute_logits(hidden[logits_rows])
        if self.logits_hook is not None:
            self.logits_hook(sampled, logits)
        check_fault("sample", sampled)
        rids, params = [s.request_id for s in sampled], [s.params for s in sampled]
        return SampledTokens(self.sampler.sample(logits, rids, params), sampled)


def _upload(parts: tuple, device: torch.device, dtype, packed: bool) -> list[torch.Tensor]:
    """``parts`` (lists or 1-d arrays) on ``device``; ``packed``: through one buffer, split
    there (views): one host-to-device copy per dtype, not one per part."""
    arrays = [np.asarray(p, dtype=dtype) for p in parts]
    if not packed:
        return [to_device(a, device) for a in arrays]
    return list(torch.split(to_device(np.concatenate(arrays), device), [len(a) for a in arrays]))
