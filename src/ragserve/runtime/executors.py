"""Executors: run the scheduler's tasks in process (tests) or in persistent worker processes."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from ragserve.runtime.config import ServerConfig
from ragserve.runtime.errors import WorkerError
from ragserve.runtime.runners import GenerationRunner, RetrievalRunner, run_isolated
from ragserve.runtime.shm import ShmRing
from ragserve.runtime.workers import WorkerSpec, encode, unpack_generation, worker_main
from ragserve.scheduler import (
    BaseExecutor,
    GenerationTask,
    GenerationUpdate,
    RetrievalResult,
    RetrievalTask,
    Update,
)

logger = logging.getLogger(__name__)

MAX_FAILED_STARTS = 3  # a worker that dies this many times before 'ready' is given up


class LocalExecutor(BaseExecutor):
    """Engine and index in this process: ``poll`` runs one engine step and the pending search."""

    def __init__(self, generation: GenerationRunner, retrieval: RetrievalRunner) -> None:
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
        """The pending search (or next retrieval sub-stage) and one engine step; while that
        yields no update (chunked generation tasks hold theirs), more of both until one comes
        or ``timeout`` has passed, as the worker processes would keep running meanwhile."""
        updates: list[Update] = list(self._errors)
        self._errors.clear()
        deadline = time.monotonic() + timeout
        while True:
            if self._pending or self.retrieval.has_pending():
                tasks, self._pending = self._pending, []
                updates.extend(run_isolated(self.retrieval, tasks))
            if self.generation.has_work():
                updates.extend(self.generation.step())
            if updates or not self.generation.has_work() or time.monotonic() >= deadline:
                return updates

    def engine_stats(self) -> dict[str, Any]:
        return self.generation.engine.stats()

    def call_retrieval(self, name: str, *args: Any) -> Future:
        return _call_now(self.retrieval, name, args)

    def call_generation(self, name: str, *args: Any) -> Future:
        """Run ``GenerationRunner.<name>(*args)`` now (between engine steps)."""
        return _call_now(self.generation, name, args)


def _call_now(runner: Any, name: str, args: tuple) -> Future:
    fut: Future = Future()
    try:
        fut.set_result(getattr(runner, name)(*args))
    except Exception as exc:
        fut.set_exception(exc)
    return fut


class WorkerHandle:
    """One worker process, its bounded inbox, result pipe and shared-memory ring."""

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
        self.ring = ShmRing(self.ctx, self.config.shm_slots, self.config.shm_slot_bytes)
        self.proc = self.ctx.Process(
            target=worker_main,
            args=(self.spec, self.inbox, child_conn, self.ring.handle()),
            name=f"ragserve-{self.spec.kind}",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        """Block until the worker has built its engine/index; raise with its traceback if not."""
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.spec.kind} worker did not start within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5.0)
            raise RuntimeError(
                f"{self.spec.kind} worker exited while starting (exit code {self.proc.exitcode})"
            ) from None
        self._on_message(msg)

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "fatal":
            raise RuntimeError(f"{self.spec.kind} worker failed to start:\n{msg[1]}")
        if msg[0] != "ready":
            raise RuntimeError(f"{self.spec.kind} worker sent {msg[0]!r} before 'ready'")
        self.ready = True

    def send(self, msg: Any) -> None:
        """Queue ``msg`` (pickled now: ``encode`` raises here if it cannot be) and flush."""
        self.pending.append(encode(msg))
        self.flush()

    @property
    def is_up(self) -> bool:
        return self.broken is None and self.ready and self.proc.is_alive()

    def flush(self) -> None:
        """Move pending messages into the bounded inbox while it has room (never blocks).
        Called from the scheduler thread only."""
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
        if self.proc.is_alive():
            with contextlib.suppress(queue.Full, ValueError, OSError):
                self.inbox.put(None, timeout=1.0)
            self.proc.join(join_timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(join_timeout)
        self.inbox.cancel_join_thread()
        self.inbox.close()
        self.conn.close()
        self.ring.close()


class ProcessExecutor(BaseExecutor):
    """The generation and retrieval workers as persistent processes (``spawn``).

    A worker that dies is restarted; the tasks it held end with an error update, requests on
    the other worker continue. Messages wait in a local queue while a worker's inbox is full
    (backpressure without blocking the scheduler).
    """

    def __init__(self, gen_spec: WorkerSpec, ret_spec: WorkerSpec, config: ServerConfig) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        self.workers = {"gen": WorkerHandle(gen_spec, config, ctx)}
        self.workers["ret"] = WorkerHandle(ret_spec, config, ctx)
        self._replies: dict[int, Future] = {}
        self._replies_lock = threading.Lock()  # call_retrieval runs in callers' threads
        self._errors: list[Update] = []
        self._tokens = itertools.count()
        try:
            for w in self.workers.values():
                w.wait_ready(config.worker_start_timeout)
        except BaseException:
            self.close()
            raise

    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        self._submit(self.workers["gen"], ("gen", tasks))

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        self._submit(self.workers["ret"], ("ret", tasks))

    def _submit(self, worker: WorkerHandle, msg: tuple) -> None:
        tasks = msg[1]
        if worker.broken is not None:
            self._errors.extend(self._failed(worker, [t.task_id for t in tasks], worker.broken))
            return
        try:
            data = encode(msg)
        except Exception:
            data, tasks = self._encode_each(worker, msg[0], tasks)
            if not tasks:
                return
        worker.in_flight.update(t.task_id for t in tasks)
        worker.pending.append(data)
        worker.flush()

    def _encode_each(self, worker: WorkerHandle, kind: str, tasks: list) -> tuple[bytes, list]:
        """The batch could not be pickled: the tasks that can go in one message; each that
        cannot fails alone (``bad_request``)."""
        good = []
        for t in tasks:
            try:
                encode(t)
            except Exception as exc:
                reason = f"the task cannot be sent to the worker: {type(exc).__name__}"
                logger.warning("task %s: %s (%s)", t.task_id, reason, exc)
                self._errors.extend(self._failed(worker, [t.task_id], reason, "bad_request"))
            else:
                good.append(t)
        return (encode((kind, good)) if good else b""), good

    def abort(self, task_ids: list[str]) -> None:
        gen = self.workers["gen"]
        gen.in_flight.difference_update(task_ids)
        gen.send(("abort", list(task_ids)))

    def call_retrieval(self, name: str, *args: Any) -> Future:
        """Run ``RetrievalRunner.<name>(*args)`` in the retrieval worker (thread-safe, never
        blocks). The future fails with ``WorkerError``: ``bad_request`` when the arguments
        cannot be pickled, ``worker_died`` when the worker dies first or is broken."""
        return self._call_worker("ret", name, args)

    def call_generation(self, name: str, *args: Any) -> Future:
        """Run ``GenerationRunner.<name>(*args)`` in the generation worker, between engine
        steps (thread-safe, never blocks; errors as ``call_retrieval``'s)."""
        return self._call_worker("gen", name, args)

    def _call_worker(self, kind: str, name: str, args: tuple) -> Future:
        token = next(self._tokens)
        fut: Future = Future()
        worker = self.workers[kind]
        if worker.broken is not None:
            fut.set_exception(WorkerError(worker.broken, "worker_died"))
            return fut
        try:
            data = encode(("call", token, name, args))
        except Exception as exc:
            reason = f"the arguments cannot be sent to the {kind} worker: {type(exc).__name__}"
            fut.set_exception(WorkerError(reason, "bad_request"))
            return fut
        with self._replies_lock:
            self._replies[token] = fut
        worker.pending.append(data)  # NOTE: flushed by the scheduler thread's next poll
        return fut

    def _fail_replies(self, reason: str, kind: str) -> None:
        with self._replies_lock:
            replies, self._replies = self._replies, {}
        for fut in replies.values():
            if not fut.done():
                fut.set_exception(WorkerError(reason, kind))

    def poll(self, timeout: float) -> list[Update]:
        live = [w for w in self.workers.values() if w.broken is None]
        for w in live:
            w.flush()
        handles = {w.conn: w for w in live}
        handles.update({w.proc.sentinel: w for w in live})
        updates: list[Update] = list(self._errors)
        self._errors.clear()
        for ready in wait(list(handles), 0.0 if updates else timeout):
            worker = handles[ready]
            if ready is worker.conn:
                updates.extend(self._receive(worker))
        for worker in live:
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

    def _unpack(self, worker: WorkerHandle, msg: tuple) -> list[Update]:
        kind = msg[0]
        if kind == "ready":
            worker.ready = True
            worker.num_failed_starts = 0
            worker.flush()
            return []
        if kind == "stats":
            worker.engine_stats = msg[1]
            return []
        if kind == "fatal":
            logger.error("%s worker failed to restart:\n%s", worker.spec.kind, msg[1])
            worker.last_error = msg[1].strip().splitlines()[-1]
            return []
        if kind == "reply":
            with self._replies_lock:
                fut = self._replies.pop(msg[1], None)
            if fut is None or fut.done():
                return []
            if msg[3] is None:
                fut.set_result(msg[2])
            else:
                error_kind, message = msg[3]
                fut.set_exception(WorkerError(message, error_kind))
            return []
        payload, arrays = msg[1], msg[2]
        if arrays is not None and not isinstance(arrays, list):
            arrays = worker.ring.read(arrays)
        if kind == "gen" and msg[3] is not None:
            worker.engine_stats = msg[3]
        updates = unpack_generation(payload, arrays) if kind == "gen" else payload
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
        if worker is self.workers["gen"]:
            return [
                GenerationUpdate(t, "", (), True, "error", error=reason, error_kind=kind)
                for t in task_ids
            ]
        return [RetrievalResult(t, (), reason, error_kind=kind) for t in task_ids]

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
        """What keeps the workers from serving now (empty: both are up)."""
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
