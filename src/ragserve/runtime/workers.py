"""The persistent worker processes: one owns the LLM engine, one the embedder and the index.
Each reads typed messages (``wire.py``) from its bounded inbox and writes results to its pipe
(rows as Arrow in its shared-memory ring, or pickled: ``payloads.py``). A result that cannot
be sent back is replaced by errors for the tasks (or call) it carried."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ragserve.runtime.arrow_batches import generation_batch, retrieval_batch, with_fields
from ragserve.runtime.errors import error_kind_of, failed_update
from ragserve.runtime.payloads import generation_bytes, retrieval_bytes, uses_arrow
from ragserve.runtime.runners import GenerationRunner, RetrievalRunner, run_isolated
from ragserve.runtime.shm import ShmWriter, ipc_stream
from ragserve.runtime.wire import (
    SMALL_MESSAGE_BYTES,
    AbortGenerationMsg,
    CallGenerationMsg,
    CallReplyMsg,
    CallRetrievalMsg,
    EngineStatsMsg,
    FatalMsg,
    GenerationResultsMsg,
    ReadyMsg,
    RetrievalResultsMsg,
    ShutdownMsg,
    SubmitGenerationMsg,
    SubmitRetrievalMsg,
    WireError,
    check_call,
    drain,
)

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # engine stats while busy without updates: at most this often
SLOT_WAIT_S = 1.0  # a result waits this long for a free shared-memory slot, then goes inline


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds at start: picklable, no live objects. ``max_message_bytes``
    bounds one result message's Arrow payload (past it the tasks fail with an error); rows
    estimated below ``small_message_bytes`` or above a slot ride pickled in the message
    instead (``payloads``);
    ``tokenizer_prefetch``: the generation runner tokenizes on a CPU thread ahead of the
    engine step (``GenerationRunner``); ``reranker``: the rerank nodes' reranker
    (``retrieval.rerank.load_reranker``; one it cannot build fails the start, in one line)."""

    kind: str  # "generation" | "retrieval"
    model: str | None = None
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    index: str | None = None
    embedder: str | None = None
    default_nprobe: int | None = None
    tier: TierSpec | None = None  # the GPU tier's settings (``retrieval.index_tier``)
    log_level: int = logging.WARNING  # of the ``ragserve`` loggers (the parent's, by default)
    max_message_bytes: int = 1 << 28
    small_message_bytes: int = SMALL_MESSAGE_BYTES
    tokenizer_prefetch: bool = True
    reranker: str = "embedding"  # ``OperatorConfig.reranker``: built by the retrieval worker


def build_runner(spec: WorkerSpec) -> GenerationRunner | RetrievalRunner:
    if spec.kind == "generation":
        return GenerationRunner.build(spec.model, spec.engine_kwargs, spec.tokenizer_prefetch)
    from ragserve.runtime.staged_retrieval import StagedRetrievalRunner

    return StagedRetrievalRunner.build(
        spec.index, spec.embedder, spec.default_nprobe, tier=spec.tier, reranker=spec.reranker
    )


def worker_main(spec: WorkerSpec, inbox: Any, conn: Any, ring_handle: Any) -> None:
    """Entry point of a worker process (``multiprocessing`` spawn)."""
    # NOTE: the workers and the server share the CPU cores. OpenMP's default spin-waiting
    # (torch, Faiss) then turns every small matmul into a ~30x slower busy wait; sleep
    # instead. Set before torch/Faiss load; an explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # NOTE: spawned workers inherit the parent's stderr: their ``ragserve`` records at the
    # parent's level (model conversion, index load) reach the same console, tagged.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s [{spec.kind} worker] %(name)s: %(message)s",
    )
    logging.getLogger("ragserve").setLevel(spec.log_level)
    _thread_local_progress_lock()
    from ragserve.retrieval.rerank import RerankerLoadError

    try:
        runner = build_runner(spec)
        writer = ShmWriter(ring_handle)
        outbox = Outbox(conn, writer, spec.max_message_bytes, spec.small_message_bytes)
    except RerankerLoadError as exc:  # a configuration error: its one line, no traceback
        conn.send(FatalMsg(str(exc)))
        return
    except BaseException:
        conn.send(FatalMsg(traceback.format_exc()))
        return
    conn.send(ReadyMsg(spec.kind))
    loop = _generation_loop if spec.kind == "generation" else _retrieval_loop
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        loop(runner, inbox, outbox)
    if isinstance(runner, GenerationRunner):
        runner.close()


class Outbox:
    """A worker's way out: typed messages to its pipe; a result's rows as an Arrow payload in
    its ring, or pickled in the message (``payloads.uses_arrow`` decides)."""

    def __init__(
        self, conn: Any, writer: ShmWriter, max_message_bytes: int, small_message_bytes: int
    ) -> None:
        self.conn = conn
        self.writer = writer
        self.max_message_bytes = max_message_bytes
        self.small_message_bytes = small_message_bytes

    def send(self, msg: Any, fallback: Callable[[str], Any]) -> None:
        """``msg`` to the pipe; if it cannot be pickled or its bytes exceed
        ``max_message_bytes``, ``fallback(reason)`` instead."""
        try:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            logger.error("a %s cannot be pickled (%s); sending errors instead", type(msg), exc)
            reason = f"the result cannot be sent back: {type(exc).__name__}"
            data = pickle.dumps(fallback(reason), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.max_message_bytes:
            reason = (
                f"the result cannot be sent back: its message of {len(data)} bytes exceeds "
                f"max_message_bytes ({self.max_message_bytes})"
            )
            logger.error("%s", reason)
            data = pickle.dumps(fallback(reason), protocol=pickle.HIGHEST_PROTOCOL)
        self.conn.send_bytes(data)

    def send_generation(self, updates: list, stats: dict | None) -> None:
        """``updates`` as a ``GenerationResultsMsg``."""
        task_ids = tuple(u.task_id for u in updates)

        def failed(reason: str) -> GenerationResultsMsg:
            errors = tuple(failed_update(t, reason) for t in task_ids)
            return GenerationResultsMsg(task_ids, None, None, errors)

        if not self._uses_arrow(generation_bytes(updates)):
            self.send(GenerationResultsMsg(task_ids, None, stats, tuple(updates)), failed)
            return
        try:
            payload = self._payload(generation_batch(updates))
        except (ValueError, OverflowError, TypeError, pa.ArrowException) as exc:
            self.send(failed(f"the result cannot be sent back: {exc}"), failed)
            return
        self.send(GenerationResultsMsg(task_ids, payload, stats), failed)

    def send_retrieval(self, results: list) -> None:
        """``results`` as a ``RetrievalResultsMsg`` (operator results carry no passages and
        ride in the message as they are)."""
        from ragserve.scheduler import RetrievalResult
        from ragserve.scheduler.messages import OperatorResult

        def error_of(r: Any, reason: str) -> Any:
            if hasattr(r, "passages"):
                return RetrievalResult(r.task_id, (), reason, error_kind="internal")
            return OperatorResult(r.task_id, error=reason, error_kind="internal")

        def failed(reason: str) -> RetrievalResultsMsg:
            return RetrievalResultsMsg(tuple(error_of(r, reason) for r in results), None)

        if not self._uses_arrow(retrieval_bytes(results)):
            self.send(RetrievalResultsMsg(tuple(results), None), failed)
            return
        try:
            slim = tuple(
                with_fields(r, passages=()) if hasattr(r, "passages") else r for r in results
            )
            payload = self._payload(retrieval_batch(results))
        except (ValueError, OverflowError, TypeError, pa.ArrowException) as exc:
            self.send(failed(f"the result cannot be sent back: {exc}"), failed)
            return
        self.send(RetrievalResultsMsg(slim, payload), failed)

    def _uses_arrow(self, num_bytes: int) -> bool:
        return uses_arrow(num_bytes, self.small_message_bytes, self.writer.slot_bytes)

    def _payload(self, batch: Any) -> Any:
        stream = ipc_stream(batch)
        if stream.size > self.max_message_bytes:
            raise ValueError(
                f"its payload of {stream.size} bytes exceeds max_message_bytes "
                f"({self.max_message_bytes})"
            )
        return self.writer.write(stream, timeout=SLOT_WAIT_S)


def _thread_local_progress_lock() -> None:
    """tqdm (the model loaders' progress bars) creates a process-shared lock, a named
    semaphore the server's resource tracker records; a worker killed with SIGKILL never
    releases it. A worker's bars need no cross-process lock."""
    try:
        import threading

        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


class _ParentWatch:
    """Whether the server process is gone: checked on every blocking read, and by the
    non-blocking reads between engine steps at most every ``interval_s`` (a check is a
    ``select`` over the parent's sentinel, more than the read itself; 0: every read)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._checked_at = -float("inf")

    def is_gone(self, block: bool) -> bool:
        now = time.monotonic()
        if not block and now - self._checked_at < self.interval_s:
            return False
        self._checked_at = now
        parent = multiprocessing.parent_process()
        return parent is not None and not parent.is_alive()


PARENT_CHECK_S = 0.5
_parent = _ParentWatch(PARENT_CHECK_S)


def _drain(inbox: Any, block: bool) -> list[Any]:
    """Queued messages (waiting up to 0.5 s for one when ``block``); ``[ShutdownMsg()]`` once
    the server process is gone (``_ParentWatch``), so a killed server leaves no orphan
    workers. A non-blocking read of an empty inbox costs one poll of its pipe."""
    if _parent.is_gone(block):
        return [ShutdownMsg()]
    if not block and inbox.empty():
        return []
    return drain(inbox, 0.5 if block else None)


def _generation_loop(runner: GenerationRunner, inbox: Any, outbox: Outbox) -> None:
    handlers: dict[type, Callable[[Any], list]] = {
        SubmitGenerationMsg: lambda msg: runner.add(list(msg.tasks)),
        AbortGenerationMsg: lambda msg: runner.abort(list(msg.task_ids)) or [],
        CallGenerationMsg: lambda msg: _call(runner, outbox, msg, "generation"),
    }
    was_busy = False
    last_stats = 0.0
    while True:
        updates = []
        for msg in _drain(inbox, block=not runner.has_work()):
            if isinstance(msg, ShutdownMsg):
                return
            updates.extend(_dispatch(handlers, msg))
        if runner.has_work():
            updates.extend(runner.step())
        busy = runner.has_work()
        now = time.monotonic()
        # NOTE: every message wakes the scheduler. Stats ride on the update message; steps
        # whose updates are held back (chunked tasks) send them at most every
        # STATS_INTERVAL_S, so a chunk of decode steps costs one wake-up, not one per step.
        stats = None
        if updates or (was_busy and not busy) or (busy and now - last_stats >= STATS_INTERVAL_S):
            stats, last_stats = runner.engine.stats(), now
        if updates:
            outbox.send_generation(updates, stats)
        elif stats is not None:
            outbox.conn.send(EngineStatsMsg(stats))
        if not busy:
            runner.run_deferred_checks()  # NOTE: after the send: off the request's path
        was_busy = busy


def _dispatch(handlers: dict[type, Callable[[Any], list]], msg: Any) -> list:
    handler = handlers.get(type(msg))
    if handler is None:
        logger.error("ignoring a message of unknown type %s", type(msg).__name__)
        return []
    return handler(msg)


def _retrieval_loop(runner: RetrievalRunner, inbox: Any, outbox: Outbox) -> None:
    handlers: dict[type, Callable[[Any], list]] = {
        SubmitRetrievalMsg: lambda msg: list(msg.tasks),
        CallRetrievalMsg: lambda msg: _call(runner, outbox, msg, "retrieval"),
    }
    while True:
        tasks = []
        pending = runner.has_pending()  # staged retrievals: next sub-stage, inbox drained first
        for msg in _drain(inbox, block=not pending):
            if isinstance(msg, ShutdownMsg):
                return
            tasks.extend(_dispatch(handlers, msg))
        if tasks or pending:  # all tasks queued since the last search go out as one batch
            outbox.send_retrieval(run_isolated(runner, tasks))


def _call(runner: Any, outbox: Outbox, msg: Any, kind: str) -> list:
    """Run the call (``CallRetrievalMsg`` / ``CallGenerationMsg``), reply to it; no tasks or
    updates come of it."""
    try:
        value = check_call(msg.method, kind)(runner, *msg.args)
        reply = CallReplyMsg(msg.token, value)
    except Exception as exc:
        logger.exception("%s call %s failed", kind, msg.method)
        error = WireError(error_kind_of(exc), f"{type(exc).__name__}: {exc}")
        reply = CallReplyMsg(msg.token, error=error)
    outbox.send(reply, lambda err: CallReplyMsg(msg.token, error=WireError("internal", err)))
    return []
