"""The worker loops, one per runner kind, shared by the worker processes (``worker_main``) and
the Ray actors (``ray_actors``): drain the inbox (``wire.py`` messages), run the runner, hand
the results to an outbox (``wire.Outbox`` for a process: its pipe and ring)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragserve.runtime.config import ServerConfig
from ragserve.runtime.runners import GenerationRunner
from ragserve.runtime.shm import ShmWriter
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner, run_isolated
from ragserve.runtime.wire import (
    AbortGenerationMsg,
    CallMsg,
    FatalMsg,
    Outbox,
    ReadyMsg,
    ShutdownMsg,
    SubmitMsg,
    check_call,
    drain,
)

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # engine stats while busy without updates: at most this often
PARENT_CHECK_S = 0.5

Drain = Callable[[bool], list]  # ``drain(block)``: the queued messages


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process builds at start: picklable, no live objects (``tier``:
    ``retrieval.index_tier``; ``log_level``: of the ``ragserve`` loggers)."""

    kind: str  # "generation" | "retrieval"
    model: str | None = None
    index: str | None = None
    embedder: str | None = None
    tier: TierSpec | None = None
    config: ServerConfig = field(default_factory=ServerConfig)
    log_level: int = logging.WARNING


def build_runner(spec: WorkerSpec) -> GenerationRunner | StagedRetrievalRunner:
    config = spec.config
    if spec.kind == "generation":
        return GenerationRunner.build(spec.model, config.engine_kwargs, config.tokenizer_prefetch)
    return StagedRetrievalRunner.build(
        spec.index,
        spec.embedder,
        config.default_nprobe,
        tier=spec.tier,
        reranker=config.operators.reranker,
    )


def worker_main(spec: WorkerSpec, inbox: Any, conn: Any, ring_handle: Any) -> None:
    """Entry point of a worker process."""
    # NOTE: the server owns shutdown: it drains in-flight requests, then sends ShutdownMsg
    # (SIGKILL after a timeout). Ctrl-C signals the terminal's whole process group and systemd
    # sends SIGTERM to the whole cgroup: a worker that died of either would be restarted and
    # fail the requests being drained. A dead server is noticed by ``_ParentWatch``.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # NOTE: the workers and the server share the CPU cores. OpenMP's default spin-waiting
    # (torch, Faiss) then turns every small matmul into a ~30x slower busy wait; sleep
    # instead. Set before torch/Faiss load; an explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s [{spec.kind} worker] %(name)s: %(message)s",
    )
    logging.getLogger("ragserve").setLevel(spec.log_level)
    # NOTE: tqdm's default lock (the model loaders' progress bars) is a named semaphore that a
    # worker killed with SIGKILL never releases; a worker's bars need no cross-process lock.
    from tqdm import tqdm  # a dependency of transformers

    from ragserve.retrieval.rerank import RerankerLoadError

    tqdm.set_lock(threading.RLock())
    try:
        runner = build_runner(spec)
        writer = ShmWriter(ring_handle)
        config = spec.config
        outbox = Outbox(conn, writer, config.max_message_bytes, config.small_message_bytes)
    except RerankerLoadError as exc:  # a configuration error: its one line, no traceback
        conn.send(FatalMsg(str(exc)))
        return
    except BaseException:
        conn.send(FatalMsg(traceback.format_exc()))
        return
    conn.send(ReadyMsg(spec.kind))
    loop = serve_generation if spec.kind == "generation" else serve_retrieval
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        loop(runner, lambda block: _drain(inbox, block), outbox)
    if isinstance(runner, GenerationRunner):
        runner.close()


class _ParentWatch:
    """Whether the server process is gone: checked on every blocking read, and by the
    non-blocking reads between engine steps at most every ``interval_s`` (0: every read)."""

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


_parent = _ParentWatch(PARENT_CHECK_S)


def _drain(inbox: Any, block: bool) -> list[Any]:
    """Queued messages (waiting up to 0.5 s for one when ``block``); ``[ShutdownMsg()]`` once
    the server process is gone, so a killed server leaves no orphan workers."""
    if _parent.is_gone(block):
        return [ShutdownMsg()]
    if not block and inbox.empty():
        return []
    return drain(inbox, 0.5 if block else None)


def serve_generation(runner: GenerationRunner, drain: Drain, outbox: Any) -> None:
    """Until a ``ShutdownMsg``: add, abort and call between engine steps; send each step's
    updates with the engine's stats."""
    was_busy = False
    last_stats = 0.0
    while True:
        updates = []
        for msg in drain(not runner.has_work()):
            if isinstance(msg, ShutdownMsg):
                return
            if isinstance(msg, SubmitMsg):
                updates.extend(runner.add(list(msg.tasks)))
            elif isinstance(msg, AbortGenerationMsg):
                runner.abort(list(msg.task_ids))
            else:
                _call(runner, outbox, msg, "generation")
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
            outbox.send_stats(stats)
        if not busy:
            runner.run_deferred_checks()  # NOTE: after the send: off the request's path
        was_busy = busy


def serve_retrieval(runner: StagedRetrievalRunner, drain: Drain, outbox: Any) -> None:
    """Until a ``ShutdownMsg``: every task queued since the last search goes in one batch
    (``run_isolated``); calls run between batches; staged retrievals advance a sub-stage per
    turn."""
    while True:
        tasks = []
        pending = runner.has_pending()
        for msg in drain(not pending):
            if isinstance(msg, ShutdownMsg):
                return
            if isinstance(msg, SubmitMsg):
                tasks.extend(msg.tasks)
            else:
                _call(runner, outbox, msg, "retrieval")
        if tasks or pending:
            outbox.send_retrieval(run_isolated(runner, tasks))


def _call(runner: Any, outbox: Any, msg: Any, kind: str) -> None:
    if not isinstance(msg, CallMsg):
        logger.error("ignoring a message of unknown type %s", type(msg).__name__)
        return
    try:
        value = check_call(msg.method, kind)(runner, *msg.args)
    except Exception as exc:
        logger.exception("%s call %s failed", kind, msg.method)
        outbox.reply(msg, None, exc)
    else:
        outbox.reply(msg, value, None)
