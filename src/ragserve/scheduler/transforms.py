"""Graph transformations: the plug point for node splitting, reordering and speculation.

The scheduler applies its transforms, in order, to every cycle's wavefront before dispatch.
A transform may reorder, split (into sub-tasks it later merges back through ``on_update``)
or add (speculative) side tasks. It must keep the contract that every task the scheduler
created receives a final update.

A transform gets a ``SchedulerView`` in ``bind(view)``, the only way it sees the scheduler
(never its executor or request objects). Through it, on the scheduler thread only:

- ``task(task_id) -> TaskView | None``: a read-only snapshot of the node run a dispatched task
  belongs to (``None`` once its request finished, failed or was aborted);
- ``has_task(task_id)``: whether ``task`` would give a view (no snapshot built);
- ``is_active(request_id)`` and ``running_task_ids(request_id)``;
- ``peek_next(task, output) -> NextStep | None``: where the request would go, and with what
  state, if the task's node returned ``output`` (``State.write``, then the node's edge);
  ``None`` when its router raises;
- ``submit_generation(tasks, request_id=None)`` / ``submit_retrieval(tasks)``: side tasks
  (speculation), dispatched with the next cycle's wavefront, after it; their updates reach
  the transforms' ``on_updates`` and never the requests; generation side tasks done for a
  request (``request_id``) have their updates coalesced as that request's own would be
  (``Scheduler``'s ``enable_update_coalescing``);
- ``abort(task_ids)``: a side task not yet dispatched is dropped; a dispatched generation is
  aborted in the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from ragserve.graph import CompiledGraph, State
from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import Wavefront


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
    """The narrow interface transforms use (see the module doc)."""

    def task(self, task_id: str) -> TaskView | None: ...

    def has_task(self, task_id: str) -> bool: ...

    def is_active(self, request_id: str) -> bool: ...

    def running_task_ids(self, request_id: str) -> tuple[str, ...]: ...

    def peek_next(self, task: TaskView, output: Any) -> NextStep | None: ...

    def submit_generation(self, tasks: list, request_id: str | None = None) -> None: ...

    def submit_retrieval(self, tasks: list) -> None: ...

    def abort(self, task_ids: list[str]) -> None: ...


def peek_next(task: TaskView, output: Any) -> NextStep | None:
    """The one implementation of "the state if this node returned ``output``" and its edge."""
    state = task.state.write(task.node, output)
    try:
        return NextStep(task.graph.next_node(task.node_id, state), state)
    except Exception:  # NOTE: a user router may raise anything
        return None


class BaseTransform(ABC):
    """One rewrite of the wavefront; stateful transforms keep their own bookkeeping.

    ``needs_partial_updates``: the transform reads generation updates before a node's last
    (its partial text), so the scheduler must not coalesce them (``Scheduler``)."""

    needs_partial_updates: bool = False

    @abstractmethod
    def apply(self, wavefront: Wavefront) -> Wavefront:
        """The wavefront to dispatch in place of ``wavefront``."""

    def bind(self, view: SchedulerView) -> None:  # noqa: B027 - optional hook
        """Called once by the ``Scheduler`` that will apply this transform, with its view."""

    def on_updates(self, updates: list[Update]) -> list[Update]:
        """Rewrite the executor's updates before the scheduler sees them (default: as is)."""
        return updates
