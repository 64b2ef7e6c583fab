"""``GenerationRunner``: the generation work, shared by every executor (the retrieval work:
``staged_retrieval.py``). One request never fails another: a task rejected on ``add`` or
failed by the engine in a step gets an error; the engine survives."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ragserve.runtime.errors import failed_update, failure
from ragserve.scheduler import GenerationTask, GenerationUpdate

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """What one task has been sent so far (mutated by ``GenerationRunner`` only)."""

    holdback: int  # characters kept back while a stop string may still be cut
    chunk_s: float | None
    chars: int = 0
    tokens: int = 0
    waited_s: float = 0.0  # engine-step seconds since the last update (chunked tasks)


class GenerationRunner:
    """Owns one ``LLMEngine``; mutates it through ``add``/``abort``/``step``.

    ``step()`` runs one engine step and returns the tasks' ``GenerationUpdate`` deltas. A task
    with ``chunk_s`` (HedraRAG §4.2) gets a non-final update only once the engine steps that
    gave it tokens add up to ``chunk_s``; its first, final and error updates go at once.
    Deltas come from the engine's cumulative text, so chunking changes only the grouping.

    ```
    engine steps:   1   2   3   4   5   6   7   8(final)     chunk_s = 3 step times
    per step:       u   u   u   u   u   u   u   u
    chunked:        u           u           u   u            (first, 4, 7, final)
    ```

    ``tokenizer_prefetch``: ``add`` hands prompts to a CPU thread (chat template, tokenize);
    ``step`` admits the ready ones in arrival order (the same token ids: identical outputs).
    """

    def __init__(
        self,
        engine: Any,
        *,
        clock: Callable[[], float] = time.perf_counter,
        tokenizer_prefetch: bool = False,
    ) -> None:
        from ragserve.generation import SamplingParams
        from ragserve.generation.segments import paragraph_segments

        self.engine = engine
        self._params_cls = SamplingParams
        self._paragraph_segments = paragraph_segments
        self._clock = clock
        self._progress: dict[str, _Progress] = {}
        self._prefetch: ThreadPoolExecutor | None = None
        if tokenizer_prefetch:
            self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ragserve-tokenize")
        self._tokenizing: dict[str, tuple[GenerationTask, Future]] = {}  # arrival order
        self.num_updates = 0  # updates returned by ``step`` so far

    @classmethod
    def build(
        cls, model: Any, engine_kwargs: Any = (), tokenizer_prefetch: bool = False
    ) -> GenerationRunner:
        if isinstance(model, (str, Path)):
            from ragserve.generation import LLMEngine

            model = LLMEngine(str(model), **dict(engine_kwargs))
        return cls(model, tokenizer_prefetch=tokenizer_prefetch)

    def add(self, tasks: list[GenerationTask]) -> list[GenerationUpdate]:
        """The error updates of the tasks rejected."""
        if self._prefetch is not None:
            for t in tasks:
                self._tokenizing[t.task_id] = (t, self._prefetch.submit(self._tokenized, t))
            return []
        return [u for t in tasks if (u := self._admit(t, None)) is not None]

    def _prompt(self, t: GenerationTask) -> Any:
        """The chat-templated text, its paragraph segments (cache fusion), or the token ids."""
        prompt = t.prompt
        if t.chat:
            turns = [*t.history, ("user", prompt)]
            prompt = self.engine.apply_chat_template(
                [{"role": role, "content": text} for role, text in turns]
            )
        elif isinstance(prompt, tuple):
            prompt = list(prompt)
        if t.params.fusion_ratio is not None and isinstance(prompt, str):
            prompt = self._paragraph_segments(prompt)
        return prompt

    def _tokenized(self, t: GenerationTask) -> Any:
        """``_prompt(t)`` tokenized (the prefetch thread); an exception is returned."""
        try:
            prompt = self._prompt(t)
        except Exception as exc:
            return exc
        if isinstance(prompt, str):
            # NOTE: on failure the text goes on: ``add_request`` tokenizes it and raises the
            # error it raises without prefetch.
            with contextlib.suppress(Exception):
                prompt = self.engine.tokenize(prompt)
        return prompt

    def _admit_tokenized(self) -> list[GenerationUpdate]:
        """Admit the ready prefetched tasks, oldest first (waiting when the engine is idle)."""
        errors = []
        while self._tokenizing:
            task_id = next(iter(self._tokenizing))
            task, future = self._tokenizing[task_id]
            if not future.done() and self.engine.has_unfinished():
                break
            del self._tokenizing[task_id]
            if (update := self._admit(task, future.result())) is not None:
                errors.append(update)
        return errors

    def _admit(self, t: GenerationTask, prompt: Any) -> GenerationUpdate | None:
        """``t`` into the engine; the error update if it is rejected."""
        try:
            if isinstance(prompt, Exception):
                raise prompt
            if prompt is None:
                prompt = self._prompt(t)
            sampling = asdict(t.params)
            ratio = sampling.pop("fusion_ratio")
            self.engine.add_request(
                t.task_id, prompt, self._params_cls(**sampling), fusion_ratio=ratio
            )
        except Exception as exc:
            # NOTE: tokenizers raise TypeError for text they cannot encode (a lone
            # surrogate); whatever this task's input does, it fails alone.
            logger.warning("generation task %s rejected: %s", t.task_id, exc)
            return failed_update(t.task_id, *failure(exc))
        holdback = max((len(s) for s in t.params.stop), default=1) - 1
        self._progress[t.task_id] = _Progress(holdback, t.chunk_s)
        return None

    def abort(self, task_ids: list[str]) -> None:
        for tid in task_ids:
            waiting = self._tokenizing.pop(tid, None)
            if waiting is not None:
                waiting[1].cancel()
            if self._progress.pop(tid, None) is not None:
                self.engine.abort(tid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self._tokenizing)

    def run_deferred_checks(self) -> None:
        """``LLMEngine.run_deferred_checks``, once a step's updates are sent."""
        run = getattr(self.engine, "run_deferred_checks", None)
        if run is not None:
            run()

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=False, cancel_futures=True)

    def set_kv_reuse(self, enabled: bool) -> dict[str, Any]:
        """``LLMEngine.set_kv_reuse`` (an idle engine; it empties the KV cache)."""
        self.engine.set_kv_reuse(enabled)
        return {"kv_reuse": enabled}

    def step(self) -> list[GenerationUpdate]:
        errors = self._admit_tokenized()
        if not self.engine.has_unfinished():
            return errors
        start = self._clock()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            return errors + self._fail_all(exc)
        seconds = self._clock() - start
        updates = []
        for out in outputs:
            progress = self._progress.get(out.request_id)
            if progress is None:
                continue
            if out.finish_reason == "error":
                updates.append(self._failed(out.request_id))
            elif not self._holds(progress, out, seconds):
                updates.append(self._delta(out, progress))
        self.num_updates += len(updates)
        return errors + updates

    def _fail_all(self, exc: Exception) -> list[GenerationUpdate]:
        """An engine step raised: every task in it fails (and is aborted, freeing blocks)."""
        logger.exception("engine step failed; failing the %d tasks it held", len(self._progress))
        failed = list(self._progress)
        self.abort(failed)
        return [failed_update(t, f"the engine step failed: {type(exc).__name__}") for t in failed]

    def _failed(self, task_id: str) -> GenerationUpdate:
        del self._progress[task_id]
        return failed_update(
            task_id, "the engine step failed for this request; details are in the worker log"
        )

    @staticmethod
    def _holds(progress: _Progress, out: Any, seconds: float) -> bool:
        if progress.chunk_s is None or out.finished or progress.tokens == 0:
            return False
        progress.waited_s += seconds
        return progress.waited_s < progress.chunk_s

    def _delta(self, out: Any, progress: _Progress) -> GenerationUpdate:
        text = out.text
        # NOTE: a stop string may still be cut from the end; hold back that many characters.
        holdback = 0 if out.finished else progress.holdback
        visible = max(progress.chars, len(text) - holdback)
        first = progress.tokens == 0 and (out.token_ids or out.finished)
        update = GenerationUpdate(
            task_id=out.request_id,
            text_delta=text[progress.chars : visible],
            new_token_ids=tuple(out.token_ids[progress.tokens :]),
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_token_ids=tuple(out.prompt_token_ids) if first else None,
            final_text=text if out.finished else None,
        )
        if out.finished:
            del self._progress[out.request_id]
        else:
            progress.chars, progress.tokens = visible, len(out.token_ids)
            progress.waited_s = 0.0
        return update
