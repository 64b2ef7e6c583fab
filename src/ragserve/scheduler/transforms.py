"""Graph transformations: the plug point for node splitting, reordering and speculation. Each
cycle the scheduler passes the wavefront through its transforms, in order, before dispatch,
and the updates after; a transform sees the scheduler only through its ``SchedulerView``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

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


class SchedulerView(Protocol):
    """What a transform sees of the scheduler (scheduler thread only): read-only ``TaskView``s
    of dispatched runs (``None`` once the request ended), ``peek_next`` (where the request
    would go, and with what state, if the task's node returned ``output``; ``None`` if its
    router raises), side tasks (dispatched after the next wavefront, their updates reach
    only ``on_updates``; ``request_id`` coalesces them as that request's own) and ``abort``."""

    def task(self, task_id: str) -> TaskView | None: ...

    def has_task(self, task_id: str) -> bool: ...

    def is_active(self, request_id: str) -> bool: ...

    def running_task_ids(self, request_id: str) -> tuple[str, ...]: ...

    def peek_next(self, task: TaskView, output: Any) -> NextStep | None: ...

    def submit_generation(self, tasks: list, request_id: str | None = None) -> None: ...

    def submit_retrieval(self, tasks: list) -> None: ...

    def abort(self, task_ids: list[str]) -> None: ...


class BaseTransform(ABC):
    """One rewrite of the wavefront and of the updates; every task the scheduler created must
    still get a final update. ``needs_partial_updates``: it reads partial generation text, so
    the scheduler must not coalesce updates."""

    needs_partial_updates: bool = False
    view: SchedulerView | None = None

    @abstractmethod
    def apply(self, wavefront: Wavefront) -> Wavefront: ...

    def bind(self, view: SchedulerView) -> None:
        """Called once by the ``Scheduler`` that will apply this transform."""
        self.view = view

    def on_updates(self, updates: list[Update]) -> list[Update]:
        return updates
