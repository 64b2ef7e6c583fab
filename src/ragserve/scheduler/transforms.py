"""Graph transformations: the plug point for node splitting, reordering and speculation.

The scheduler applies its transforms, in order, to every cycle's wavefront before dispatch.
A transform may reorder, split (into sub-tasks it later merges back through ``on_update``)
or add (speculative) side tasks through its ``SchedulerView`` (``scheduler.view``), the only
way it sees the scheduler. It must keep the contract that every task the scheduler created
receives a final update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ragserve.scheduler.executor import Update
from ragserve.scheduler.messages import Wavefront
from ragserve.scheduler.view import SchedulerView


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
