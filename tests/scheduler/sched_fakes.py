"""A deterministic in-memory executor: the scheduler's test double (no model, no index).

Generation "writes" ``g(<first 12 chars of the prompt>)`` in two updates; retrieval returns
``topk`` passages whose ids derive from the query. Every call is recorded for assertions.
"""

from __future__ import annotations

import zlib

from ragserve.graph import Passage
from ragserve.scheduler import (
    BaseExecutor,
    GenerationTask,
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
)


class FakeExecutor(BaseExecutor):
    def __init__(self, fail_prompts_with: str | None = None) -> None:
        self.fail_prompts_with = fail_prompts_with
        self.generation_calls: list[list[GenerationTask]] = []
        self.retrieval_calls: list[list[RetrievalTask]] = []
        self.aborted: list[str] = []
        self._running: dict[str, tuple[str, int]] = {}  # task id -> (text, steps done)
        self._results: list[RetrievalResult] = []

    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        self.generation_calls.append(list(tasks))
        for t in tasks:
            self._running[t.task_id] = (f"g({t.prompt[:12]})", 0)

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        self.retrieval_calls.append(list(tasks))
        for t in tasks:
            base = zlib.crc32(t.query.encode()) % 1000
            docs = tuple(
                Passage(f"d{base + i}", f"text {base + i}", f"T{base + i}") for i in range(t.topk)
            )
            self._results.append(RetrievalResult(t.task_id, docs))

    def abort(self, task_ids: list[str]) -> None:
        self.aborted.extend(task_ids)
        for tid in task_ids:
            self._running.pop(tid, None)

    def poll(self, timeout: float) -> list:
        updates: list = list(self._results)
        self._results.clear()
        for tid, (text, done) in list(self._running.items()):
            if self.fail_prompts_with and self.fail_prompts_with in text:
                updates.append(GenerationUpdate(tid, "", (), True, error="boom"))
                del self._running[tid]
                continue
            half = len(text) // 2
            chunk = text[:half] if done == 0 else text[half:]
            finished = done == 1
            updates.append(
                GenerationUpdate(tid, chunk, (done,), finished, "length" if finished else None)
            )
            if finished:
                del self._running[tid]
            else:
                self._running[tid] = (text, 1)
        return updates
