"""The executor contract: where the scheduler's tasks run (in process, or worker processes)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ragserve.scheduler.messages import (
    GenerationTask,
    GenerationUpdate,
    OperatorResult,
    OperatorTask,
    RetrievalResult,
    RetrievalTask,
)

Update = GenerationUpdate | RetrievalResult | OperatorResult


class BaseExecutor(ABC):
    """Runs the scheduler's tasks (its only caller, one thread): generation tasks join the
    engine's batch, one cycle's retrieval tasks are searched as one batch. ``poll(timeout)``
    waits at most ``timeout`` for updates; every task gets a final update, possibly with
    ``error`` (also when a worker dies). ``abort``: no more updates for those generations.
    ``wake()`` (any thread, only with ``can_wake``) makes a waiting ``poll`` return."""

    can_wake: bool = False

    @abstractmethod
    def submit_generation(self, tasks: list[GenerationTask]) -> None: ...

    @abstractmethod
    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None: ...

    def submit_operators(self, tasks: list[OperatorTask]) -> None:
        """By default operators share the retrieval batch (told apart by type)."""
        self.submit_retrieval(tasks)  # type: ignore[arg-type]

    @abstractmethod
    def abort(self, task_ids: list[str]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float) -> list[Update]: ...

    def wake(self) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
