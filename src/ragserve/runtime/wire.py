"""The typed messages between the server and its worker processes, and the fixed tables of
methods a call message may name (docs/architecture.md "Data plane")."""

from __future__ import annotations

import pickle
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ragserve.scheduler import GenerationTask, RetrievalTask

SMALL_MESSAGE_BYTES = 1 << 20  # smaller results ride pickled (``payloads.py``; BENCHMARKS.md)


@dataclass(frozen=True)
class SubmitMsg:
    tasks: tuple[GenerationTask | RetrievalTask, ...]


@dataclass(frozen=True)
class AbortGenerationMsg:
    task_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallMsg:
    """Run ``runner.<method>(*args)`` (``CALLS``) in the worker, between engine steps or
    searches; the answer is a ``CallReplyMsg`` with the same ``token``."""

    token: int
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class ShutdownMsg:
    pass


@dataclass(frozen=True)
class ShmRef:
    """An Arrow IPC stream of ``num_bytes`` at the start of shared-memory slot ``slot``."""

    slot: int
    num_bytes: int


@dataclass(frozen=True)
class InlineArrow:
    """An Arrow IPC stream sent through the pipe (it did not fit a slot, or none was free)."""

    data: bytes


ArrowPayload = ShmRef | InlineArrow


@dataclass(frozen=True)
class ReadyMsg:
    kind: str


@dataclass(frozen=True)
class FatalMsg:
    traceback: str


@dataclass(frozen=True)
class EngineStatsMsg:
    stats: dict[str, Any]


@dataclass(frozen=True)
class GenerationResultsMsg:
    """The ``GenerationUpdate``s of ``task_ids``: one row each in ``payload``, or, when
    ``payload`` is ``None``, in ``updates`` (a small message); ``stats``: the engine's, or
    ``None``."""

    task_ids: tuple[str, ...]
    payload: ArrowPayload | None
    stats: dict[str, Any] | None = None
    updates: tuple[Any, ...] = ()


@dataclass(frozen=True)
class RetrievalResultsMsg:
    """``results`` (``RetrievalResult``, ``StagedRetrievalResult``, ``RetrievalPartial``,
    ``OperatorResult``) without their passages, which ``payload`` holds, one row per result;
    when ``payload`` is ``None`` (a small message) the results carry their passages."""

    results: tuple[Any, ...]
    payload: ArrowPayload | None


@dataclass(frozen=True)
class WireError:
    kind: str  # a ``WorkerError`` kind
    message: str


@dataclass(frozen=True)
class CallReplyMsg:
    """The value a ``CallMsg`` returned (pickled: any Python value), or its error."""

    token: int
    value: Any = None
    error: WireError | None = None


RETRIEVAL_CALLS = (
    "add_documents",
    "delete_documents",
    "embed",
    "set_gpu_tier",
    "drop_gpu_tier",
    "gpu_tier_stats",
)
CALLS = {"retrieval": RETRIEVAL_CALLS, "generation": ("set_kv_reuse",)}  # what a caller may run


def check_call(method: str, kind: str = "retrieval") -> Callable[..., Any]:
    """``fn(runner, *args)`` running ``runner.<method>(*args)`` for a ``method`` listed in
    ``CALLS[kind]``; ``ValueError`` naming it if not."""
    if method not in CALLS[kind]:
        raise ValueError(
            f"method {method!r} is not a {kind} call; choose one of {', '.join(CALLS[kind])}"
        )
    return lambda runner, *args: getattr(runner, method)(*args)


def encode(msg: Any) -> bytes:
    """``msg`` pickled now: its errors raise here, in the sender."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def drain(inbox: Any, timeout: float | None) -> list[Any]:
    """Every message queued in ``inbox`` (unpickled), waiting up to ``timeout`` seconds for the
    first (``None``: not at all)."""
    msgs = []
    try:
        msgs.append(inbox.get_nowait() if timeout is None else inbox.get(timeout=timeout))
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return [pickle.loads(m) if isinstance(m, bytes) else m for m in msgs]
