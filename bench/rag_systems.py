"""The systems the RAG benchmark compares, as scheduler transforms over one Server design.

- ``sequential``: one request at a time per stage (a retrieval service and an LLM that each
  take the next request only when the previous one is done), like LangChain/FlashRAG
  pipelines over vLLM + Faiss with no co-scheduling.
- ``stagewise``: stages of one kind at a time, each as one batch run to completion, then the
  other kind (generation and retrieval never overlap), like FlashRAG's batch pipeline over
  vLLM + Faiss: batching, but no CPU-GPU overlap.
- ``async``: every ready stage is submitted at once (the scheduler's default): naive async.
- ``ragserve``: split + similarity + speculation; ``split``/``similarity``/``speculation``:
  each alone (ablation).

Every system also gets ``FixedLengthTransform`` (fixed output lengths, as with random
weights; ``rag_bench.workflow_graphs`` sets the same on the graphs' nodes, which speculative
generations read) and ``TimedTransform`` wrappers that measure the transforms' own overhead.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from ragserve.scheduler import BaseTransform, GenerationUpdate, RetrievalResult, Wavefront
from ragserve.scheduler.cosched import CoScheduleConfig, make_transforms

SYSTEMS = ("sequential", "stagewise", "async", "ragserve", "split", "similarity", "speculation")


class _HoldingTransform(BaseTransform):
    """A baseline that holds tasks back (``_held`` per kind, FIFO) and releases them later."""

    def __init__(self) -> None:
        self._held: dict[str, deque] = {"gen": deque(), "ret": deque()}
        self._view = None

    def bind(self, view) -> None:
        self._view = view

    def _hold(self, wavefront: Wavefront) -> None:
        self._held["gen"].extend(wavefront.generation)
        self._held["ret"].extend(wavefront.retrieval)


class SerialStagesTransform(_HoldingTransform):
    """Hold tasks back so at most one retrieval and one generation run at a time (FIFO)."""

    def __init__(self) -> None:
        super().__init__()
        self._busy: dict[str, str | None] = {"gen": None, "ret": None}

    def apply(self, wavefront: Wavefront) -> Wavefront:
        self._hold(wavefront)
        out = Wavefront()
        for kind, target in (("gen", out.generation), ("ret", out.retrieval)):
            alive = self._view.task
            if self._busy[kind] is not None and alive(self._busy[kind]) is None:
                self._busy[kind] = None  # its request was aborted or failed
            while self._busy[kind] is None and self._held[kind]:
                task = self._held[kind].popleft()
                if alive(task.task_id) is not None:
                    self._busy[kind] = task.task_id
                    target.append(task)
        return out

    def on_updates(self, updates: list) -> list:
        for u in updates:
            if isinstance(u, RetrievalResult) and u.task_id == self._busy["ret"]:
                self._busy["ret"] = None
            elif isinstance(u, GenerationUpdate) and u.finished and u.task_id == self._busy["gen"]:
                self._busy["gen"] = None
        return updates


class StagewiseTransform(_HoldingTransform):
    """Alternate batch phases: release every held task of one kind at once, wait until all of
    them finished, then do the same for the other kind. New tasks wait for their kind's turn."""

    def __init__(self) -> None:
        super().__init__()
        self._in_flight: set[str] = set()
        self._last = "ret"

    def apply(self, wavefront: Wavefront) -> Wavefront:
        self._hold(wavefront)
        alive = self._view.task
        self._in_flight = {t for t in self._in_flight if alive(t) is not None}
        out = Wavefront()
        if self._in_flight:
            return out
        for kind in ("gen", "ret") if self._last == "ret" else ("ret", "gen"):
            tasks = [t for t in self._held[kind] if alive(t.task_id) is not None]
            self._held[kind].clear()
            if tasks:
                self._last = kind
                self._in_flight = {t.task_id for t in tasks}
                (out.generation if kind == "gen" else out.retrieval).extend(tasks)
                break
        return out

    def on_updates(self, updates: list) -> list:
        for u in updates:
            if isinstance(u, RetrievalResult) or (isinstance(u, GenerationUpdate) and u.finished):
                self._in_flight.discard(u.task_id)
        return updates


class FixedLengthTransform(BaseTransform):
    """Every generation runs exactly ``max_tokens`` (no EOS, no stop strings)."""

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.generation = [
            dataclasses.replace(
                t, params=dataclasses.replace(t.params, ignore_eos=True, stop=(), stop_token_ids=())
            )
            for t in wavefront.generation
        ]
        return wavefront


class TimedTransform(BaseTransform):
    """Wraps a transform and accumulates the seconds spent in it."""

    def __init__(self, inner: BaseTransform) -> None:
        self.inner = inner
        self.seconds = 0.0

    def bind(self, view) -> None:
        self.inner.bind(view)

    def apply(self, wavefront: Wavefront) -> Wavefront:
        t0 = time.perf_counter()
        try:
            return self.inner.apply(wavefront)
        finally:
            self.seconds += time.perf_counter() - t0

    def on_updates(self, updates: list) -> list:
        t0 = time.perf_counter()
        try:
            return self.inner.on_updates(updates)
        finally:
            self.seconds += time.perf_counter() - t0


def system_transforms(name: str, *, first_clusters: int, budget_s: float | None = None) -> tuple:
    """The transform chain of system ``name`` (each co-scheduling transform timed)."""
    full = CoScheduleConfig(budget_s=budget_s, spec_first_clusters=first_clusters)
    configs = {
        "ragserve": full,
        "split": dataclasses.replace(full, enable_similarity=False, enable_speculation=False),
        "similarity": dataclasses.replace(full, enable_split=False, enable_speculation=False),
        "speculation": dataclasses.replace(full, enable_split=False, enable_similarity=False),
    }
    if name == "sequential":
        chain: tuple = (SerialStagesTransform(),)
    elif name == "stagewise":
        chain = (StagewiseTransform(),)
    elif name == "async":
        chain = ()
    elif name in configs:
        chain = make_transforms(configs[name])
    else:
        raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
    return (*(TimedTransform(t) for t in chain), FixedLengthTransform())
