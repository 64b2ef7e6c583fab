"""Executors: the scheduler's tasks in process (tests) or in persistent worker processes."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from ragserve.runtime.config import ServerConfig
from ragserve.runtime.errors import WorkerError, failed_results
from ragserve.runtime.runners import GenerationRunner
from ragserve.runtime.shm import ShmRing
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner, run_isolated
from ragserve.runtime.wire import (
    AbortGenerationMsg,
    CallMsg,
    CallReplyMsg,
    EngineStatsMsg,
    FatalMsg,
    GenerationResultsMsg,
    ReadyMsg,
    RetrievalResultsMsg,
    ShutdownMsg,
    SubmitMsg,
    check_call,
    encode,
    read_results,
)
from ragserve.runtime.worker_start import worker_context, worker_process
from ragserve.runtime.workers import WorkerSpec, worker_main
from ragserve.scheduler import (
    BaseExecutor,
    GenerationTask,
    GenerationUpdate,
    RetrievalTask,
    Update,
)

logger = logging.getLogger(__name__)

MAX_FAILED_STARTS = 3  # a worker that dies this many times before 'ready' is given up


class LocalExecutor(BaseExecutor):
    """Engine and index in this process."""

    def __init__(self, generation: GenerationRunner, retrieval: StagedRetrievalRunner) -> None:
        self.generation = generation
        self.retrieval = retrieval
        self._pending: list[RetrievalTask] = []
        self._errors: list[GenerationUpdate] = []

    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        self._errors.extend(self.generation.add(tasks))

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        self._pending.extend(tasks)

    def abort(self, task_ids: list[str]) -> None:
        self.generation.abort(task_ids)

    def poll(self, timeout: float) -> list[Update]:
        """The pending search (or sub-stage) and an engine step, repeated until one yields an
        update or ``timeout`` passes (as the worker processes would keep running)."""
        updates: list[Update] = list(self._errors)
        self._errors.clear()
        deadline = time.monotonic() + timeout
        while True:
            if self._pending or self.retrieval.has_pending():
                tasks, self._pending = self._pending, []
                updates.extend(run_isolated(self.retrieval, tasks))
            if self.generation.has_work():
                updates.extend(self.generation.step())
                if not self.generation.has_work():
                    self.generation.run_deferred_checks()
            if updates or not self.generation.has_work() or time.monotonic() >= deadline:
                return updates

    def engine_stats(self) -> dict[str, Any]:
        return self.generation.engine.stats()

    def call_retrieval(self, name: str, *args: Any) -> Future:
        return self._call_now(self.retrieval, name, args, "retrieval")

    def call_generation(self, name: str, *args: Any) -> Future:
        return self._call_now(self.generation, name, args, "generation")

    @staticmethod
    def _call_now(runner: Any, name: str, args: tuple, kind: str) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(check_call(name, kind)(runner, *args))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        self.generation.close()


class WorkerHandle:
    """One worker process, its bounded inbox, result pipe and shared-memory ring. ``pending``:
    encoded messages waiting for room in the inbox (past ``config.max_pending_messages`` tasks
    fail as ``overloaded``; an abort or shutdown always queues)."""

    def __init__(self, spec: WorkerSpec, config: ServerConfig, ctx: Any) -> None:
        self.spec, self.config, self.ctx = spec, config, ctx
        self.in_flight: set[str] = set()
        self.pending: collections.deque = collections.deque()  # messages waiting for room
        self.num_restarts = 0
        self.num_failed_starts = 0  # consecutive restarts that died before 'ready'
        self.last_error = ""
        self.broken: str | None = None  # set when the worker cannot be started any more
        self.engine_stats: dict[str, Any] = {}
        self._start()

    def _start(self) -> None:
        self.inbox = self.ctx.Queue(maxsize=self.config.queue_size)
        self.conn, child_conn = self.ctx.Pipe(duplex=False)
        self.ring = ShmRing(self.config.shm_slots, self.config.shm_slot_bytes)
        self.proc = worker_process(
            self.ctx,
            worker_main,
            (self.spec, self.inbox, child_conn, self.ring.handle()),
            f"ragserve-{self.spec.kind}",
        )
        self.proc.start()
        child_conn.close()
        self.ready = False

    def read_ready(self) -> None:
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5.0)
            raise RuntimeError(
                f"{self.spec.kind} worker exited while starting (exit code {self.proc.exitcode})"
            ) from None
        if isinstance(msg, FatalMsg):
            detail = msg.traceback.strip()
            sep = "\n" if "\n" in detail else " "  # a one-line reason stays one line
            raise RuntimeError(f"{self.spec.kind} worker failed to start:{sep}{detail}")
        if not isinstance(msg, ReadyMsg):
            raise RuntimeError(f"{self.spec.kind} worker sent {type(msg).__name__} before ready")
        self.ready = True

    def send(self, msg: Any) -> None:
        self.pending.append(encode(msg))
        self.flush()

    def flush(self) -> None:
        """Move pending messages into the inbox while it has room (never blocks)."""
        while self.pending and self.ready:
            try:
                self.inbox.put_nowait(self.pending[0])
            except queue.Full:
                return
            self.pending.popleft()

    def restart(self) -> str:
        code = self.proc.exitcode
        self.close(join_timeout=1.0)
        self.num_restarts += 1
        logger.warning("%s worker died (exit code %s); restarting", self.spec.kind, code)
        self._start()
        return f"{self.spec.kind} worker died (exit code {code}); it has been restarted"

    def close(self, join_timeout: float = 5.0) -> None:
        if self.inbox is None:  # closed before
            return
        if self.proc.is_alive():
            with contextlib.suppress(queue.Full, ValueError, OSError):
                self.inbox.put(encode(ShutdownMsg()), timeout=1.0)
            self.proc.join(join_timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(join_timeout)
        self.inbox.cancel_join_thread()
        self.inbox.close()
        # NOTE: dropped, so its semaphores are unlinked now (their finalizers run on garbage
        # collection); a server that uvicorn ends by re-raising SIGTERM runs no exit handlers,
        # and the resource tracker would warn about them as leaked.
        self.inbox, self.ready = None, False
        self.conn.close()
        self.ring.close()


def _wait_all_ready(workers: list[WorkerHandle], timeout: float) -> None:
    """Block until every worker is ready; raise as soon as one fails or at ``timeout``."""
    deadline = time.monotonic() + timeout
    waiting = {w.conn: w for w in workers}
    while waiting:
        ready = wait(list(waiting), max(deadline - time.monotonic(), 0.0))
        if not ready:
            late = next(iter(waiting.values())).spec.kind
            raise RuntimeError(f"{late} worker did not start within {timeout:.0f} s")
        for conn in ready:
            waiting.pop(conn).read_ready()


class Waker:
    """A socket pair to wait on beside the workers' pipes: ``wake`` (any thread) makes it
    readable until ``drain``; once closed, ``wake`` does nothing."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._w.send(b"w")

    def drain(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: nothing left
            while self._r.recv(4096):
                pass

    def close(self) -> None:
        self._w.close()
        self._r.close()


class ProcessExecutor(BaseExecutor):
    """The generation and retrieval workers as persistent processes (``worker_start.py``). A
    worker that dies is restarted and the tasks it held fail; past a worker's bounded queues
    tasks fail as ``overloaded`` and calls raise ``WorkerError("overloaded")``."""

    can_wake = True

    def __init__(self, gen_spec: WorkerSpec, ret_spec: WorkerSpec, config: ServerConfig) -> None:
        self.config = config
        self._waker = Waker()
        ctx = worker_context(config.worker_start_method)
        self.workers = {"gen": WorkerHandle(gen_spec, config, ctx)}
        self.workers["ret"] = WorkerHandle(ret_spec, config, ctx)
        self._replies: dict[int, Future] = {}
        self._replies_lock = threading.Lock()  # call_retrieval runs in callers' threads
        self._errors: list[Update] = []
        self._tokens = itertools.count()
        try:
            _wait_all_ready(list(self.workers.values()), config.worker_start_timeout)
        except BaseException:
            for w in self.workers.values():  # NOTE: a start failed: the others stop at once
                if not w.ready:
                    w.proc.kill()
            self.close()
            raise

    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        self._submit(self.workers["gen"], tasks)

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        self._submit(self.workers["ret"], tasks)

    def _refusal(self, worker: WorkerHandle) -> WorkerError | None:
        if worker.broken is not None:
            return WorkerError(worker.broken, "worker_died")
        if len(worker.pending) >= self.config.max_pending_messages:
            return WorkerError(
                f"the {worker.spec.kind} worker's queue is full "
                f"({self.config.max_pending_messages} messages waiting); retry later",
                "overloaded",
            )
        return None

    def _submit(self, worker: WorkerHandle, tasks: list) -> None:
        refusal = self._refusal(worker)
        if refusal is not None:
            self._errors.extend(
                self._failed(worker, [t.task_id for t in tasks], str(refusal), refusal.kind)
            )
            return
        try:
            data = encode(SubmitMsg(tuple(tasks)))
        except Exception:  # NOTE: each task that cannot be pickled fails alone
            tasks = [t for t in tasks if self._encodes(worker, t)]
            if not tasks:
                return
            data = encode(SubmitMsg(tuple(tasks)))
        worker.in_flight.update(t.task_id for t in tasks)
        worker.pending.append(data)
        worker.flush()

    def _encodes(self, worker: WorkerHandle, task: Any) -> bool:
        try:
            encode(task)
        except Exception as exc:
            reason = f"the task cannot be sent to the worker: {type(exc).__name__}"
            logger.warning("task %s: %s (%s)", task.task_id, reason, exc)
            self._errors.extend(self._failed(worker, [task.task_id], reason, "bad_request"))
            return False
        return True

    def abort(self, task_ids: list[str]) -> None:
        gen = self.workers["gen"]
        gen.in_flight.difference_update(task_ids)
        gen.send(AbortGenerationMsg(tuple(task_ids)))

    def call_retrieval(self, name: str, *args: Any) -> Future:
        """Run ``StagedRetrievalRunner.<name>(*args)`` in the retrieval worker (thread-safe, never
        blocks). The future fails with ``WorkerError``: ``bad_request`` when the arguments
        cannot be pickled or ``name`` is not in ``CALLS``, ``worker_died`` when the worker
        dies first or is broken, ``overloaded`` when its queue is full."""
        return self._call_worker(self.workers["ret"], name, args)

    def call_generation(self, name: str, *args: Any) -> Future:
        """``call_retrieval`` for the generation worker (run between engine steps)."""
        return self._call_worker(self.workers["gen"], name, args)

    def _call_worker(self, worker: WorkerHandle, name: str, args: tuple) -> Future:
        token = next(self._tokens)
        fut: Future = Future()
        kind = worker.spec.kind
        try:
            refusal = self._refusal(worker)
            if refusal is not None:
                raise refusal
            try:
                check_call(name, kind)
            except ValueError as exc:
                raise WorkerError(str(exc), "bad_request") from None
            try:
                data = encode(CallMsg(token, name, args))
            except Exception as exc:
                reason = f"the arguments cannot be sent to the {kind} worker: {type(exc).__name__}"
                raise WorkerError(reason, "bad_request") from None
        except WorkerError as exc:
            fut.set_exception(exc)
            return fut
        with self._replies_lock:
            self._replies[token] = fut
        worker.pending.append(data)  # NOTE: flushed by the scheduler thread's next poll
        self.wake()
        return fut

    def _fail_replies(self, reason: str, kind: str) -> None:
        with self._replies_lock:
            replies, self._replies = self._replies, {}
        for fut in replies.values():
            if not fut.done():
                fut.set_exception(WorkerError(reason, kind))

    def wake(self) -> None:
        self._waker.wake()

    def poll(self, timeout: float) -> list[Update]:
        live = [w for w in self.workers.values() if w.broken is None]
        for w in live:
            w.flush()
        handles: dict[Any, Any] = {w.conn: w for w in live}
        handles.update({w.proc.sentinel: w for w in live})
        handles[self._waker] = None
        updates: list[Update] = list(self._errors)
        self._errors.clear()
        exited = []
        for ready in wait(list(handles), 0.0 if updates else timeout):
            worker = handles[ready]
            if worker is None:
                self._waker.drain()
            elif ready is worker.conn:
                updates.extend(self._receive(worker))
            else:
                exited.append(worker)  # NOTE: a sentinel is ready once its process has ended
        for worker in exited:
            if not worker.proc.is_alive():
                updates.extend(self._receive(worker))
                updates.extend(self._on_death(worker))
        return updates

    def _receive(self, worker: WorkerHandle) -> list[Update]:
        updates: list[Update] = []
        try:
            while worker.conn.poll():
                updates.extend(self._unpack(worker, worker.conn.recv()))
        except (EOFError, OSError):
            pass
        return updates

    def _unpack(self, worker: WorkerHandle, msg: Any) -> list[Update]:
        if isinstance(msg, (GenerationResultsMsg, RetrievalResultsMsg)):
            return self._on_results(worker, msg)
        if isinstance(msg, CallReplyMsg):
            with self._replies_lock:
                fut = self._replies.pop(msg.token, None)
            if fut is not None and not fut.done():
                if msg.error is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(WorkerError(msg.error.message, msg.error.kind))
        elif isinstance(msg, EngineStatsMsg):
            worker.engine_stats = msg.stats
        elif isinstance(msg, ReadyMsg):
            worker.ready, worker.num_failed_starts = True, 0
            worker.flush()
        elif isinstance(msg, FatalMsg):
            logger.error("%s worker failed to restart:\n%s", worker.spec.kind, msg.traceback)
            worker.last_error = msg.traceback.strip().splitlines()[-1]
        else:
            logger.error("%s worker sent a %s; ignored", worker.spec.kind, type(msg).__name__)
        return []

    def _on_results(self, worker: WorkerHandle, msg: Any) -> list[Update]:
        """The rows of ``msg``; one that cannot be read fails the tasks it carried."""
        is_gen = isinstance(msg, GenerationResultsMsg)
        try:
            updates = read_results(msg, worker.ring)
        except ValueError as exc:
            logger.error("a %s worker result could not be read: %s", worker.spec.kind, exc)
            reason = f"the {worker.spec.kind} worker's result could not be read: {exc}"
            ids = msg.task_ids if is_gen else [r.task_id for r in msg.results]
            updates = self._failed(worker, ids, reason, "internal")
        if is_gen and msg.stats is not None:
            worker.engine_stats = msg.stats
        done = [u.task_id for u in updates if getattr(u, "finished", True)]
        worker.in_flight.difference_update(done)
        return updates

    def _on_death(self, worker: WorkerHandle) -> list[Update]:
        worker.num_failed_starts = 0 if worker.ready else worker.num_failed_starts + 1
        if worker.num_failed_starts >= MAX_FAILED_STARTS:
            worker.broken = (
                f"{worker.spec.kind} worker cannot be restarted "
                f"({worker.num_failed_starts} failed starts): {worker.last_error}"
            )
            logger.error("%s", worker.broken)
            worker.close(join_timeout=1.0)
            reason = worker.broken
        else:
            reason = worker.restart()
        lost, worker.in_flight = worker.in_flight, set()
        worker.pending.clear()  # their tasks are all in ``lost``
        if worker is self.workers["ret"]:
            self._fail_replies(reason, "worker_died")
        return self._failed(worker, lost, reason)

    def _failed(
        self, worker: WorkerHandle, task_ids: Any, reason: str, kind: str = "worker_died"
    ) -> list[Update]:
        return failed_results(worker.spec.kind == "generation", task_ids, reason, kind)

    def engine_stats(self) -> dict[str, Any]:
        return dict(self.workers["gen"].engine_stats)

    def stats(self) -> dict[str, Any]:
        return {
            name: {
                "in_flight": len(w.in_flight),
                "pending": len(w.pending),
                "restarts": w.num_restarts,
                "alive": w.proc.is_alive(),
                "ready": w.ready,
                "broken": w.broken is not None,
            }
            for name, w in self.workers.items()
        }

    def health(self) -> list[str]:
        problems = []
        for w in self.workers.values():
            if w.broken is not None:
                problems.append(w.broken)
            elif not w.proc.is_alive():
                problems.append(f"{w.spec.kind} worker is not running")
            elif not w.ready:
                problems.append(f"{w.spec.kind} worker is starting")
        return problems

    def close(self) -> None:
        self._fail_replies("the Server is closing", "worker_died")
        for w in self.workers.values():
            w.close()
        self._waker.close()
