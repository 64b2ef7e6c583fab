"""The work itself, shared by the in-process executor and the worker processes.

``GenerationRunner`` turns tasks into ``LLMEngine`` requests and engine outputs into
``GenerationUpdate`` deltas. ``RetrievalRunner`` embeds one batch of queries and searches them
together (one search per distinct ``nprobe``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from ragserve.graph import Passage
from ragserve.scheduler import GenerationTask, GenerationUpdate, RetrievalResult, RetrievalTask

logger = logging.getLogger(__name__)


class GenerationRunner:
    """Owns one ``LLMEngine``; mutates it through ``add``/``abort``/``step``."""

    def __init__(self, engine: Any) -> None:
        from ragserve.generation import SamplingParams

        self.engine = engine
        self._params_cls = SamplingParams
        self._sent: dict[str, tuple[int, int]] = {}  # task id -> (chars sent, tokens sent)
        self._holdback: dict[str, int] = {}

    def add(self, tasks: list[GenerationTask]) -> list[GenerationUpdate]:
        """Add tasks to the engine; returns error updates for those it rejected."""
        errors = []
        for t in tasks:
            try:
                prompt = t.prompt
                if t.chat:
                    prompt = self.engine.apply_chat_template([{"role": "user", "content": prompt}])
                elif isinstance(prompt, tuple):
                    prompt = list(prompt)
                self.engine.add_request(t.task_id, prompt, self._params_cls(**asdict(t.params)))
            except (ValueError, TypeError) as exc:
                errors.append(
                    GenerationUpdate(
                        t.task_id, "", (), True, "error", error=str(exc), error_kind="bad_request"
                    )
                )
                continue
            self._sent[t.task_id] = (0, 0)
            self._holdback[t.task_id] = max((len(s) for s in t.params.stop), default=1) - 1
        return errors

    def abort(self, task_ids: list[str]) -> None:
        for tid in task_ids:
            if self._sent.pop(tid, None) is not None:
                self._holdback.pop(tid, None)
                self.engine.abort(tid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[GenerationUpdate]:
        updates = []
        for out in self.engine.step():
            if out.request_id not in self._sent:
                continue
            updates.append(self._delta(out))
        return updates

    def _delta(self, out: Any) -> GenerationUpdate:
        chars, ntok = self._sent[out.request_id]
        text = out.text
        # NOTE: a stop string may still be cut from the end; hold back that many characters.
        holdback = 0 if out.finished else self._holdback[out.request_id]
        visible = max(chars, len(text) - holdback)
        delta = text[chars:visible]
        first = ntok == 0 and (out.token_ids or out.finished)
        update = GenerationUpdate(
            task_id=out.request_id,
            text_delta=delta,
            new_token_ids=tuple(out.token_ids[ntok:]),
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_token_ids=tuple(out.prompt_token_ids) if first else None,
            final_text=text if out.finished else None,
        )
        if out.finished:
            del self._sent[out.request_id], self._holdback[out.request_id]
        else:
            self._sent[out.request_id] = (visible, len(out.token_ids))
        return update


class RetrievalRunner:
    """Owns the embedder and the ``VectorIndex``; searches a batch of tasks at once."""

    def __init__(self, index: Any, embedder: Any, default_nprobe: int | None = None) -> None:
        self.index = index
        self.embedder = embedder
        self.default_nprobe = default_nprobe

    def run(
        self, tasks: list[RetrievalTask]
    ) -> tuple[list[RetrievalResult], np.ndarray, np.ndarray]:
        """Results (passages) plus the raw ``ids``/``scores`` ``[n, kmax]`` (``-1`` padded)."""
        kmax = max(t.topk for t in tasks)
        ids = np.full((len(tasks), kmax), -1, dtype=np.int64)
        scores = np.zeros((len(tasks), kmax), dtype=np.float32)
        vectors = self.embedder.encode([t.query for t in tasks], is_query=True)
        groups: dict[int | None, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            groups[t.nprobe or self.default_nprobe].append(i)
        for nprobe, rows in groups.items():
            topk = max(tasks[i].topk for i in rows)
            kwargs = {} if nprobe is None else {"nprobe": nprobe}
            found = self.index.search(vectors[rows], topk, **kwargs)
            ids[rows, :topk] = found.ids
            scores[rows, :topk] = found.scores
        results = []
        for i, t in enumerate(tasks):
            row = [int(x) for x in ids[i, : t.topk] if x >= 0]
            docs = self.index.get_documents(row) if row else []
            passages = tuple(
                Passage(d.id, d.text, d.title, float(scores[i, j]))
                for j, d in enumerate(docs)
                if d is not None
            )
            results.append(RetrievalResult(t.task_id, passages))
        return results, ids, scores

    def has_pending(self) -> bool:
        """Whether staged retrievals wait for more sub-stages (``run([])`` advances them)."""
        return False

    def add_documents(self, docs: list) -> Any:
        return self.index.add_documents(docs)

    def delete_documents(self, doc_ids: list[str]) -> Any:
        return self.index.delete_documents(doc_ids)
