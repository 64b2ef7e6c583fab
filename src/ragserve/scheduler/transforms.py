"""Graph transformations: the plug point for node splitting, reordering and speculation. Each
cycle the scheduler passes the wavefront through its transforms, in order, before dispatch,
and the updates after; a transform sees the scheduler only through its ``SchedulerView``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragserve.graph import CompiledGraph, State
from ragserve.scheduler.messages import Update, Wavefront


@dataclass(frozen=True)
class TaskView:
    """One dispatched node run, as of now. ``state`` is what the node read: do not mutate."""

    task_id: str
    request_id: str
    graph: CompiledGraph
    node_id: Any
    state: State
    partial_text: str  # a running generation's text so far
    num_tokens: int  # tokens it has produced so far

    @property
    def node(self) -> Any:
        return self.graph.nodes[self.node_id]


@dataclass(frozen=True)
class NextStep:
    """``node_id``: the next node id, ``END``, or a fan-out's tuple; ``state``: what it sees."""

    node_id: Any
    state: State


class SchedulerView:
    """What a transform sees of one scheduler (scheduler thread only): read-only ``TaskView``s
    of dispatched runs (``None`` once the request ended), ``peek_next`` (where the request
    would go, and with what state, if the task's node returned ``output``; ``None`` if its
    router raises), side tasks (dispatched after the next wavefront, their updates reach
    only ``on_updates``; ``request_id`` coalesces them as that request's own) and ``abort``."""

    def __init__(self, scheduler: Any) -> None:
        self._s = scheduler

    def task(self, task_id: str) -> TaskView | None:
        entry = self._s._by_task.get(task_id)
        if entry is None:
            return None
        req, run = entry
        return TaskView(
            task_id,
            req.request_id,
            req.graph,
            run.node_id,
            run.state,
            run.partial_text,
            run.timing.num_tokens,
        )

    def has_task(self, task_id: str) -> bool:
        return task_id in self._s._by_task

    def is_active(self, request_id: str) -> bool:
        return request_id in self._s._active

    def running_task_ids(self, request_id: str) -> tuple[str, ...]:
        req = self._s._active.get(request_id)
        if req is None:
            return ()
        return tuple(r.task_id for r in req.runs if r.task_id is not None)

    def peek_next(self, task: TaskView, output: Any) -> NextStep | None:
        state = task.state.write(task.node, output)
        try:
            return NextStep(task.graph.next_node(task.node_id, state), state)
        except Exception:  # NOTE: a user router may raise anything
            return None

    def submit_generation(self, tasks: list, request_id: str | None = None) -> None:
        req = None if request_id is None else self._s._active.get(request_id)
        if req is not None:
            tasks = [self._s._coalesced(req, t) for t in tasks]
        self._s._side.generation.extend(tasks)

    def submit_retrieval(self, tasks: list) -> None:
        self._s._side.retrieval.extend(tasks)

    def abort(self, task_ids: list[str]) -> None:
        ids = set(task_ids)
        side = self._s._side
        queued = {t.task_id for t in side.generation} & ids
        side.generation = [t for t in side.generation if t.task_id not in ids]
        side.retrieval = [t for t in side.retrieval if t.task_id not in ids]
        dispatched = [t for t in task_ids if t not in queued]
        if dispatched:
            self._s.executor.abort(dispatched)


class BaseTransform:
    """One rewrite of the wavefront and of the updates (each the identity unless overridden);
    every task the scheduler created must still get a final update. ``needs_partial_updates``:
    it reads partial generation text, so the scheduler must not coalesce updates."""

    needs_partial_updates: bool = False
    view: SchedulerView | None = None

    def apply(self, wavefront: Wavefront) -> Wavefront:
        return wavefront

    def bind(self, view: SchedulerView) -> None:
        """Called once by the ``Scheduler`` that will apply this transform."""
        self.view = view

    def on_updates(self, updates: list[Update]) -> list[Update]:
        return updates
