"""Speculative generation (HedraRAG §4.3, RAGCache §5.3): start the next greedy generation on
a retrieval's partial top-k, while in-flight generations / ``capacity`` < ``tau``; adopt it
if the final top-k is the same and the real task has exactly its prompt and parameters (so
greedy decoding gives the same tokens), else abort it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ragserve.graph import GenerationNode, RetrievalNode
from ragserve.scheduler.messages import (
    GenerationTask,
    GenerationUpdate,
    RetrievalPartial,
    RetrievalResult,
    Update,
    Wavefront,
    as_staged,
)
from ragserve.scheduler.scheduler import generation_task
from ragserve.scheduler.transforms import BaseTransform, TaskView


@dataclass
class _Spec:
    spec_id: str
    retrieval_task_id: str
    request_id: str
    node_id: Any
    task: GenerationTask
    doc_ids: tuple[str, ...]
    buffered: list[GenerationUpdate] = field(default_factory=list)
    confirmed: bool = False  # the final top-k equals the partial it started from
    adopted_as: str | None = None  # the real task id it stands for


@dataclass
class SpeculationStats:
    """Counters; ``accuracy`` = confirmed / resolved (HedraRAG's speculation accuracy)."""

    num_started: int = 0
    num_confirmed: int = 0
    num_wrong: int = 0  # final top-k differed: aborted
    num_adopted: int = 0
    num_aborted: int = 0  # all aborts (wrong docs, replaced partials, other routes)
    num_failed: int = 0  # ended with an error before adoption: dropped, the real task runs

    @property
    def accuracy(self) -> float | None:
        resolved = self.num_confirmed + self.num_wrong
        return None if resolved == 0 else self.num_confirmed / resolved


class SpeculationTransform(BaseTransform):
    """``first_clusters``: cut a first sub-stage of this many clusters, for an early
    partial; ``max_restarts``: how often a newer, different partial may replace a speculation."""

    def __init__(
        self, tau: float = 0.75, capacity: int = 64, first_clusters: int = 0, max_restarts: int = 1
    ) -> None:
        self.tau, self.capacity = tau, capacity
        self.first_clusters, self.max_restarts = first_clusters, max_restarts
        self.stats = SpeculationStats()
        self._specs: dict[str, _Spec] = {}  # spec id -> spec
        self._by_retrieval: dict[str, _Spec] = {}
        self._restarts: dict[str, int] = {}  # retrieval task id -> replacements so far
        self._replay: list[GenerationUpdate] = []
        self._running: set[str] = set()
        self._seq = 0

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [self._with_partials(t) for t in wavefront.retrieval]
        kept = [t for t in wavefront.generation if not self._adopt(t)]
        self._drop_stale()
        self._running.update(t.task_id for t in kept)
        wavefront.generation = kept
        return wavefront

    def _with_partials(self, task):
        first = getattr(task, "first_clusters", 0) or self.first_clusters
        return as_staged(task, emit_partials=True, first_clusters=first)

    def _adopt(self, task: GenerationTask) -> bool:
        run = self.view.task(task.task_id)
        spec = self._match(run, task) if run is not None else None
        if spec is None:
            return False
        spec.adopted_as = task.task_id
        self.stats.num_adopted += 1
        # NOTE: ``_replay`` holds every adoption of this cycle: whether this speculation has
        # finished is read from its own updates, never from ``_replay[-1]`` (another
        # request's; docs/scale_out.md, the lost adopted task).
        replay = [dataclasses.replace(u, task_id=task.task_id) for u in spec.buffered]
        spec.buffered = []
        self._replay.extend(replay)
        if replay and replay[-1].finished:
            self._forget(spec)
        return True

    def _match(self, run: TaskView, task: GenerationTask) -> _Spec | None:
        for spec in self._specs.values():
            if spec.request_id != run.request_id or not spec.confirmed:
                continue
            # NOTE: the same work up to how updates are coalesced: the same greedy tokens
            same = dataclasses.replace(spec.task, task_id=task.task_id, chunk_s=task.chunk_s)
            if spec.adopted_as is None and spec.node_id == run.node_id and same == task:
                return spec
        return None

    def _drop_stale(self) -> None:
        for spec in list(self._specs.values()):
            if self._is_stale(spec):
                self._abort(spec)
        has_task = self.view.has_task
        self._running = {t for t in self._running if t in self._specs or has_task(t)}

    def _is_stale(self, spec: _Spec) -> bool:
        """Request gone; retrieval ended unconfirmed; confirmed but not adopted by the real
        task dispatched this cycle; or adopted by a task no longer running."""
        view = self.view
        if not view.is_active(spec.request_id):
            return True
        if not spec.confirmed:
            return not view.has_task(spec.retrieval_task_id)
        if spec.adopted_as is None:
            return True
        return spec.adopted_as not in view.running_task_ids(spec.request_id)

    def on_updates(self, updates: list[Update]) -> list[Update]:
        out: list[Update] = list(self._replay)
        self._replay = []
        for u in updates:
            if isinstance(u, RetrievalPartial):
                self._on_partial(u)
            elif isinstance(u, GenerationUpdate) and u.task_id in self._specs:
                out.extend(self._on_spec_update(self._specs[u.task_id], u))
            else:
                if isinstance(u, RetrievalResult):
                    self._on_final(u)
                elif isinstance(u, GenerationUpdate) and u.finished:
                    self._running.discard(u.task_id)
                out.append(u)
        return out

    def _on_spec_update(self, spec: _Spec, u: GenerationUpdate) -> list[Update]:
        if u.finished:
            self._running.discard(spec.spec_id)
        if spec.adopted_as is None and u.error is not None:
            self.stats.num_failed += 1
            self._forget(spec)  # e.g. its replica died: the real task will run as usual
            return []
        if spec.adopted_as is None:
            spec.buffered.append(u)
            return []
        if u.finished:
            self._forget(spec)
        return [dataclasses.replace(u, task_id=spec.adopted_as)]

    def _on_final(self, result: RetrievalResult) -> None:
        self._restarts.pop(result.task_id, None)
        spec = self._by_retrieval.get(result.task_id)
        if spec is None:
            return
        if result.error is None and _ids(result.passages) == spec.doc_ids:
            spec.confirmed = True
            self.stats.num_confirmed += 1
        else:
            self.stats.num_wrong += 1
            self._abort(spec)

    def _on_partial(self, partial: RetrievalPartial) -> None:
        run = self.view.task(partial.task_id)
        if run is None or not partial.passages:
            return
        old = self._by_retrieval.get(partial.task_id)
        if old is not None:
            if old.doc_ids == _ids(partial.passages):
                return
            if self._restarts.get(partial.task_id, 0) >= self.max_restarts:
                return
            self._restarts[partial.task_id] = self._restarts.get(partial.task_id, 0) + 1
            self._abort(old)
        if len(self._running) / self.capacity >= self.tau:
            return
        made = self._speculative_task(run, partial)
        if made is None:
            return
        task, node_id = made
        spec = _Spec(
            task.task_id, partial.task_id, run.request_id, node_id, task, _ids(partial.passages)
        )
        self._specs[spec.spec_id] = spec
        self._by_retrieval[partial.task_id] = spec
        # dispatched after the next wavefront; coalesced as the request's own task would be
        self.view.submit_generation([task], request_id=run.request_id)
        self._running.add(task.task_id)
        self.stats.num_started += 1

    def _speculative_task(self, run: TaskView, partial: RetrievalPartial) -> tuple | None:
        """The (task, node id) the scheduler would run next if ``partial`` were final."""
        if not isinstance(run.node, RetrievalNode):
            return None
        step = self.view.peek_next(run, list(partial.passages))
        if step is None or isinstance(step.node_id, tuple):
            return None
        node = run.graph.nodes.get(step.node_id)
        if not isinstance(node, GenerationNode) or node.temperature != 0.0:
            return None
        self._seq += 1
        task_id = f"spec/{self._seq}/{partial.task_id}"
        return generation_task(task_id, node, step.state), step.node_id

    def _abort(self, spec: _Spec) -> None:
        self.view.abort([spec.spec_id])  # dropped if not dispatched yet, else aborted
        self.stats.num_aborted += 1
        self._forget(spec)

    def _forget(self, spec: _Spec) -> None:
        self._specs.pop(spec.spec_id, None)
        self._running.discard(spec.spec_id)
        if self._by_retrieval.get(spec.retrieval_task_id) is spec:
            del self._by_retrieval[spec.retrieval_task_id]

    @property
    def num_in_flight(self) -> int:
        return len(self._specs)

    def check_integrity(self) -> None:
        for retrieval_task_id, spec in self._by_retrieval.items():
            assert self._specs.get(spec.spec_id) is spec, spec.spec_id
            assert spec.retrieval_task_id == retrieval_task_id, spec.spec_id
        for spec_id, spec in self._specs.items():
            assert spec.spec_id == spec_id
            assert spec.adopted_as is None or (spec.confirmed and not spec.buffered), spec_id
        assert not self._replay, "replayed updates left over after on_updates"


def _ids(passages) -> tuple[str, ...]:
    return tuple(p.doc_id for p in passages)
