"""``WorkerError`` and how a failed task's error is reported. ``kind`` is the scheduler's
``ErrorKind`` the HTTP front maps to a status: ``"worker_died"`` (503), ``"timeout"`` (503),
``"overloaded"`` (429), ``"bad_request"`` (400), ``"internal"`` (500)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ragserve.scheduler import GenerationUpdate, RetrievalResult
from ragserve.scheduler.messages import EmbedTask, OperatorResult, RerankTask, UpsertTask

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    def __init__(self, message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.kind = kind


class ShardDiedError(RuntimeError):
    """A shard actor died during a call (and, for idempotent calls, again on the retry)."""


def error_kind_of(exc: BaseException) -> str:
    """``"bad_request"`` for failures a request's own input causes (bad values, text a
    tokenizer cannot encode), ``"worker_died"`` for a dead shard, else ``"internal"``."""
    if isinstance(exc, ShardDiedError):
        return "worker_died"
    return "bad_request" if isinstance(exc, (ValueError, TypeError)) else "internal"


def failure(exc: BaseException) -> tuple[str, str]:
    """``(message, kind)`` for a task ``exc`` failed: a bad request's own message; for anything
    else only the exception's type (the details go to the worker's log, not to the client)."""
    kind = error_kind_of(exc)
    return (str(exc) if kind == "bad_request" else f"{type(exc).__name__} in the worker"), kind


def isolated(
    run: Callable[[list], list], tasks: list, fail: Callable[[Any, Exception], Any]
) -> list:
    """``run(tasks)``; if the batch raises, each task alone, so a bad one fails alone
    (``fail(task, exc)``) and the others get their results."""
    try:
        return run(tasks)
    except Exception as exc:
        if len(tasks) <= 1:
            return [fail(t, exc) for t in tasks]
        logger.warning("a batch of %d tasks failed (%s); one by one", len(tasks), exc)
    return [r for t in tasks for r in isolated(run, [t], fail)]


def error_result(item: Any, message: str, kind: str) -> RetrievalResult | OperatorResult:
    """The error result in place of ``item``, a retrieval task or result (an ``OperatorResult``
    for an operator's)."""
    if isinstance(item, (EmbedTask, RerankTask, UpsertTask, OperatorResult)):
        return OperatorResult(item.task_id, error=message, error_kind=kind)
    return RetrievalResult(item.task_id, (), message, error_kind=kind)


def failed_result(task: Any, exc: BaseException) -> RetrievalResult | OperatorResult:
    """``task``'s error result for ``exc``."""
    logger.warning("task %s failed: %s: %s", task.task_id, type(exc).__name__, exc)
    return error_result(task, *failure(exc))


def failed_update(task_id: str, reason: str, kind: str = "internal") -> GenerationUpdate:
    return GenerationUpdate(task_id, "", (), True, "error", error=reason, error_kind=kind)


def failed_results(is_generation: bool, task_ids: Any, reason: str, kind: str) -> list[Any]:
    """An error update (generation) or result (retrieval) for each of ``task_ids``."""
    if is_generation:
        return [failed_update(t, reason, kind) for t in task_ids]
    return [RetrievalResult(t, (), reason, error_kind=kind) for t in task_ids]
