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
    """Runs generation and retrieval tasks; the scheduler is its only caller (one thread).

    Contract:
    - ``submit_generation`` adds tasks to the LLM engine's running batch; ``submit_retrieval``
      receives one cycle's retrieval tasks, which are embedded and searched as one batch.
    - ``poll(timeout)`` returns the updates available, waiting at most ``timeout`` seconds when
      there are none. Every submitted task eventually yields a final update (finished
      generation or a retrieval result), possibly with ``error`` set — also when a worker dies.
    - ``abort`` stops generation tasks; no further updates arrive for them.
    - ``wake()`` (any thread) makes a ``poll`` waiting now, or the next one, return early;
      only executors with ``can_wake`` implement it (the scheduler then may poll longer).
    """

    can_wake: bool = False

    @abstractmethod
    def submit_generation(self, tasks: list[GenerationTask]) -> None: ...

    @abstractmethod
    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None: ...

    def submit_operators(self, tasks: list[OperatorTask]) -> None:
        """Embed / rerank / upsert tasks for the retrieval worker, answered with
        ``OperatorResult``s. By default they share the retrieval batch message (the retrieval
        runner tells them apart by type)."""
        self.submit_retrieval(tasks)  # type: ignore[arg-type]

    @abstractmethod
    def abort(self, task_ids: list[str]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float) -> list[Update]: ...

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Interrupt a waiting ``poll`` (thread-safe); by default nothing (see ``can_wake``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers and resources."""
