"""The LLM engine: ``add_request`` / ``step`` / ``abort`` over a paged KV cache.

NOTE (overlapped steps): a request that step n ends was already launched in step n+1; its
blocks are freed at once while step n+1 may still write its row's KV into them. Every later
user of a block runs after step n+1 in stream order, and on CPU a step has run when it returns.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Sequence_
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ragserve.generation.builtin import resolve_model
from ragserve.generation.config import EngineConfig, ModelConfig, PromptTooLongError
from ragserve.generation.detokenizer import (
    IncrementalDetokenizer,
    check_finished,
    find_stop,
    make_decoder,
)
from ragserve.generation.engine_setup import (
    load_tokenizer,
    make_kv_tiers,
    resolve_device_dtype,
    resolve_kv_pool,
    resolve_max_model_len,
)
from ragserve.generation.faults import check_fault
from ragserve.generation.kv_cache_manager import TieredBlockManager
from ragserve.generation.loader import load_model
from ragserve.generation.model_runner import ModelRunner, SampledTokens
from ragserve.generation.sampling_params import SamplingParams
from ragserve.generation.scheduler import Scheduler, SchedulerOutput
from ragserve.generation.segments import FusionPlan, Segment, tokenize_segments
from ragserve.generation.sequence import RequestOutput, Sequence
from ragserve.generation.step_isolation import execute_isolated, random_state

logger = logging.getLogger(__name__)

# ``TieredBlockManager`` counters in ``stats()`` (``num_host_blocks_total``: ``num_host_blocks``)
_TIER_COUNTERS = (
    "num_host_hit_tokens", "num_swapped_out_blocks", "num_swapped_in_blocks",
    "num_evicted_gpu_blocks", "num_evicted_host_blocks", "num_swap_skipped_blocks",
    "num_swap_out_skipped_blocks", "num_host_blocks_total",
)  # fmt: skip


class _Inflight(NamedTuple):
    """A launched step whose tokens have not been read (``None``: nothing in it samples)."""

    out: SchedulerOutput
    tokens: SampledTokens | None


class LLMEngine:
    """A continuous-batching engine for one model on one device; not thread-safe."""

    def __init__(self, model: str | Path, **kwargs: Any):
        config = EngineConfig(model=str(model), **kwargs)
        is_dummy = config.load_format == "dummy" and (Path(config.model) / "config.json").is_file()
        self.model_dir = None if is_dummy else resolve_model(config.model)
        folder = self.model_dir or Path(config.model)
        self.model_config = ModelConfig.from_folder(folder)
        device, dtype = resolve_device_dtype(config)
        if device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.tokenizer = load_tokenizer(folder)
        self._decode = make_decoder(self.tokenizer, config.enable_fast_detokenize)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = self.model_config.eos_token_ids or (() if eos is None else (int(eos),))
        max_positions = resolve_max_model_len(config, self.model_config)
        model = load_model(self.model_config, folder, config, device, dtype, max_positions)
        self.config, num_blocks = resolve_kv_pool(config, self.model_config, device, dtype)
        self.model_runner = ModelRunner(model, self.model_config, self.config, num_blocks)
        self.block_manager, self.host_kv_cache = make_kv_tiers(
            config, self.model_config, self.model_runner.kv_cache, self.tokenizer
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            fairness_window=self._fairness_window(config.enable_prefix_caching),
            overlap_swap_in=config.overlap_swap_in and self.host_kv_cache is not None,
            max_model_len=self.config.max_model_len,
        )
        self._seqs: dict[str, Sequence] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._integrity_due = False  # the engine went idle; its check is deferred
        self._inflight: _Inflight | None = None  # overlapped scheduling: the launched step
        self._carried: list[RequestOutput] = []  # outputs of a step whose successor raised
        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, backend %s",
            self.model_config.architecture,
            device,
            dtype,
            num_blocks,
            config.block_size,
            self.model_runner.backend.name,
        )

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | list[Segment],
        params: SamplingParams,
        *,
        segment_ends: Sequence_[int] | None = None,
        fusion_ratio: float | None = None,
    ) -> None:
        """Queue a request (on ``ValueError`` nothing changed); ``Segment`` prompts with a
        ``fusion_ratio`` fuse; ``segment_ends``: document ends for the knowledge tree."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if (params.stop or isinstance(prompt, str)) and self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids and no stop strings")
        ratio = self.config.fusion_ratio if fusion_ratio is None else float(fusion_ratio)
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"request {request_id!r}: fusion_ratio must be in [0, 1], got {ratio}")
        spans = None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], Segment):
            tokenize = None if self.tokenizer is None else self._tokenize_segment
            ids, spans = tokenize_segments(prompt, tokenize)
        elif isinstance(prompt, str):
            ids = self._tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"request {request_id!r}: token id outside [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"request {request_id!r}: prompt has {len(ids)} tokens but the context holds "
                f"{self.max_model_len} (room for at least one generated token is needed)"
            )
        seq = Sequence(request_id, ids, params)
        if segment_ends is None and spans is not None:
            segment_ends = [end for _, end, _ in spans]
        if segment_ends is not None:
            seq.segment_ends = _check_segment_ends(request_id, segment_ends, len(ids))
        if spans is not None and ratio is not None and any(k is not None for *_, k in spans):
            seq.fusion = FusionPlan(tuple(spans), ratio)
        self._seqs[request_id] = seq
        self._detoks[request_id] = IncrementalDetokenizer(self.tokenizer, seq, self._decode)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (unknown ids are ignored)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        """Requests queued or running, or outputs held back by a raising step."""
        return self.scheduler.has_unfinished() or bool(self._carried)

    def step(self) -> list[RequestOutput]:
        """One iteration: the requests that got a token or finished (overlapped: of the step
        the previous call launched); a request that raises alone ends with ``"error"``."""
        carried, self._carried = self._carried, []
        self.run_deferred_checks()
        out = self.scheduler.schedule()
        ops = self.block_manager.take_swap_ops()
        if ops:
            self.host_kv_cache.run(ops)
        if self.config.enable_async_scheduling:
            return carried + self._step_overlapped(out)
        return carried + self._run_step(out)

    def _run_step(self, out: SchedulerOutput) -> list[RequestOutput]:
        if out.is_empty:
            return []
        self._wait_for_swaps(out)
        if not self.config.enable_step_isolation:
            return self._postprocess(out, self.model_runner.execute_model(out))
        ran = execute_isolated(self.model_runner.execute_model, out, self.model_runner.sampler)
        failed = [self._fail(seq, exc) for seq, exc in ran.failed]
        return failed + self._postprocess(ran.out, ran.tokens)

    def _step_overlapped(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Launch ``out``, then land the step launched before it (its outputs)."""
        prev, self._inflight = self._inflight, None
        if out.is_empty:
            return self._land(prev)
        self._wait_for_swaps(out)
        isolated = self.config.enable_step_isolation
        state = random_state(out, self.model_runner.sampler) if isolated else None
        try:
            tokens = self.model_runner.launch_model(out, None if prev is None else prev.tokens)
        except Exception:
            if state is not None:
                self.model_runner.sampler.set_state(state)
            # NOTE: once the previous step has landed, ``out`` runs again synchronously:
            # step isolation bisects it (or the error leaves ``step``) as without overlap.
            landed = self._land(prev)
            try:
                return landed + self._run_step(out.keep(self._is_live))
            except Exception:
                self._carried = landed
                raise
        for seq, flag in zip(out.seqs, out.sample, strict=True):
            seq.num_pending_tokens += flag
        self._inflight = _Inflight(out, tokens)
        try:
            return self._land(prev)
        finally:  # NOTE: also when landing raises (isolation off): the next step needs it
            self.scheduler.update_after_step(out.keep(self._is_live))

    def _wait_for_swaps(self, out: SchedulerOutput) -> None:
        """The step waits for the pending host-tier copies of the GPU blocks it uses."""
        if self.host_kv_cache is not None:
            self.host_kv_cache.wait_for(_step_blocks(out.seqs))

    def _land(self, step: _Inflight | None) -> list[RequestOutput]:
        if step is None:
            return []
        tokens = [] if step.tokens is None else step.tokens.tolist()
        return self._postprocess(step.out, tokens, landed=True)

    def _is_live(self, seq: Sequence) -> bool:
        """Still this engine's request (not finished or aborted since it was scheduled)."""
        return self._seqs.get(seq.request_id) is seq

    def _postprocess(
        self, out: SchedulerOutput, tokens: list[int], *, landed: bool = False
    ) -> list[RequestOutput]:
        """Append ``out``'s sampled tokens. ``landed``: an overlapped step (computed tokens
        advanced at launch; tokens of requests ended since are dropped)."""
        if not landed:
            self.scheduler.update_after_step(out)
        sampled = [s for s, flag in zip(out.seqs, out.sample, strict=True) if flag]
        outputs = []
        for seq, token in zip(sampled, tokens, strict=True):
            if landed:
                seq.num_pending_tokens -= 1
                if not self._is_live(seq):
                    continue
            try:
                outputs.append(self._append_token(seq, token))
            except Exception as exc:
                if not self.config.enable_step_isolation:
                    raise
                outputs.append(self._fail(seq, exc))
        if not self.has_unfinished():
            self._integrity_due = True
            if not self.config.enable_deferred_integrity_check:
                self.run_deferred_checks()
        return outputs

    def run_deferred_checks(self) -> None:
        """The integrity check due since the engine last went idle, if any (idempotent)."""
        if self._integrity_due:
            self._integrity_due = False
            self.block_manager.check_integrity()

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        logger.error("request %s failed in an engine step", seq.request_id, exc_info=exc)
        seq.error = f"{type(exc).__name__}: {exc}"
        if seq.request_id in self._seqs:
            self._finish(seq, "error")
        return seq.to_output()

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        check_fault("append", [seq])
        seq.append_token(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        old_len = self._detoks[seq.request_id].update(seq)
        reason = check_finished(seq, token, self.eos_token_ids, self.max_model_len)
        if seq.params.stop:
            cut = find_stop(seq.text, seq.params.stop, old_len)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is not None:
            self._finish(seq, reason)
        return seq.to_output()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.model_runner.sampler.release(seq.request_id)
        del self._seqs[seq.request_id]
        del self._detoks[seq.request_id]

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (with whatever else is queued); outputs in prompt order."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, per_prompt, strict=True):
                self.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                self.abort(rid)
            raise
        wanted, final = set(ids), {}
        while len(final) < len(wanted):
            final |= {o.request_id: o for o in self.step() if o.finished and o.request_id in wanted}
        while self._inflight is not None and not self.scheduler.has_unfinished():
            self.step()  # lands a step that held only requests finished since
        self.run_deferred_checks()
        return [final[rid] for rid in ids]

    def tokenize(self, prompt: str) -> list[int]:
        """The token ids ``add_request`` makes of ``prompt``; thread-safe next to ``step``."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self._tokenize(prompt)

    def _tokenize_segment(self, text: str, is_first: bool) -> list[int]:
        if is_first:
            return self._tokenize(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _tokenize(self, prompt: str) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and prompt.startswith(bos))
        return list(self.tokenizer(prompt, add_special_tokens=add_special)["input_ids"])

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a chat (the tokenizer's template, or a plain fallback)."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def stats(self) -> dict[str, int]:
        """Queue, KV-tier and cache-fusion counters (ints; ``docs/architecture.md``; 0 for a
        tier the engine does not have)."""
        bm, sched, fusion = self.block_manager, self.scheduler, self.model_runner.fusion
        host, tiered = self.host_kv_cache, isinstance(bm, TieredBlockManager)
        per_block = host.bytes_per_block if host is not None else 0
        hits = sched.prefix_cache_hit_tokens
        tier = {k: getattr(bm, k.removesuffix("_total")) if tiered else 0 for k in _TIER_COUNTERS}
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "preemptions": sched.num_preemptions,
            "prefix_cache_hit_tokens": hits,
            "prefix_cache_query_tokens": sched.prefix_cache_query_tokens,
            "num_prefill_tokens_saved": hits,
            "num_fused_tokens": fusion.num_fused_tokens,
            "num_recomputed_tokens": fusion.num_recomputed_tokens,
            "num_deferred_swap_ins": sched.num_deferred_swap_ins,
            **tier,
            "num_gpu_hit_tokens": bm.num_gpu_hit_tokens if tiered else hits,
            "num_swap_out_bytes": tier["num_swapped_out_blocks"] * per_block,
            "num_swap_in_bytes": tier["num_swapped_in_blocks"] * per_block,
            "num_swap_copies": host.num_copies if host is not None else 0,
            "num_kv_tree_nodes": len(bm.nodes) if tiered else 0,
            "num_host_blocks_used": bm.num_host_used_blocks if tiered else 0,
            "num_fusion_store_hits": bm.num_passage_hits if tiered else fusion.store.num_hits,
            "num_fusion_store_misses": bm.num_passage_misses if tiered else fusion.store.num_misses,
        }

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()

    def set_kv_reuse(self, enabled: bool) -> None:
        """Turn KV reuse across requests (and cache-aware admission) on or off on an idle
        engine (else ``RuntimeError``); either way the cache is emptied."""
        if not isinstance(enabled, bool):
            raise ValueError(f"set_kv_reuse: enabled must be a bool, got {enabled!r}")
        if self.has_unfinished():
            raise RuntimeError("set_kv_reuse needs an idle engine (requests are unfinished)")
        self.block_manager.reset_prefix_cache()
        self.block_manager.enable_prefix_caching = enabled
        self.scheduler.fairness_window = self._fairness_window(enabled)

    def _fairness_window(self, kv_reuse: bool) -> int | None:
        """The scheduler's window: cache-aware admission runs only with KV reuse."""
        aware = kv_reuse and self.config.enable_cache_aware_scheduling
        return self.config.cache_aware_fairness_window if aware else None

    def synchronize_kv(self) -> None:
        """Wait for every pending host-tier copy (before reading KV blocks outside ``step``)."""
        if self.host_kv_cache is not None:
            self.host_kv_cache.synchronize()


def _step_blocks(seqs: Sequence_[Sequence]) -> list[int]:
    """The GPU blocks a step reads or writes: block tables and fused passages' blocks."""
    passages = [b for seq in seqs for handle in seq.passage_blocks or () for b in handle.blocks]
    return [b for seq in seqs for b in seq.block_table] + passages


def _check_segment_ends(request_id: str, ends: Sequence_[int], num_tokens: int) -> tuple[int, ...]:
    out = tuple(int(e) for e in ends)
    if not out or out[-1] != num_tokens or any(b <= a for a, b in itertools.pairwise((0, *out))):
        raise ValueError(
            f"request {request_id!r}: segment_ends must increase from above 0 and end at the "
            f"prompt length {num_tokens}, got {list(out)}"
        )
    return out
