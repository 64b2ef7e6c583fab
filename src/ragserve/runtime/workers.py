"""The persistent worker processes: one owns the LLM engine, one the embedder and the index.

Each worker reads messages from its bounded inbox (``multiprocessing.Queue``), writes results
to its own pipe, and puts numpy arrays (token ids) in the shared-memory ring instead of
pickling them; retrieval results carry their passages in the message. Messages in:

    ("gen", [GenerationTask])   ("abort", [task_id])          generation worker
    ("ret", [RetrievalTask])                                  retrieval worker
    ("call", token, name, args)                               either: runner.<name>(*args)
    None                                                      shut down

Messages out: ("ready", info), ("fatal", traceback), ("gen", updates, ShmRef | arrays,
stats | None), ("stats", stats), ("ret", results, None), ("reply", token, value,
error).

Messages in arrive pickled by the sender (``encode``), so a message that cannot be pickled
fails in the caller's thread with an error, never silently in the queue's feeder thread. A
message out that cannot be pickled is replaced by errors for the tasks (or call) it carried.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ragserve.runtime.errors import error_kind_of
from ragserve.runtime.runners import GenerationRunner, RetrievalRunner, run_isolated
from ragserve.runtime.shm import ShmWriter

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # engine stats while busy without updates: at most this often


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds at start: picklable, no live objects."""

    kind: str  # "generation" | "retrieval"
    model: str | None = None
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    index: str | None = None
    embedder: str | None = None
    default_nprobe: int | None = None
    tier: tuple[int, str, str] | None = None  # (budget_bytes, device, dtype) of the GPU tier
    log_level: int = logging.WARNING  # of the ``ragserve`` loggers (the parent's, by default)


def build_runner(spec: WorkerSpec) -> GenerationRunner | RetrievalRunner:
    if spec.kind == "generation":
        from ragserve.generation import LLMEngine

        return GenerationRunner(LLMEngine(spec.model, **dict(spec.engine_kwargs)))
    from ragserve.retrieval import VectorIndex, load_embedder
    from ragserve.runtime.staged_retrieval import StagedRetrievalRunner

    index = VectorIndex.load(spec.index)
    if spec.tier is not None:
        budget, device, dtype = spec.tier
        index.set_gpu_tier(budget, device=device, dtype=dtype)
    embedder = load_embedder(spec.embedder or index.embedder_name)
    return StagedRetrievalRunner(index, embedder, spec.default_nprobe)


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
    try:
        runner = build_runner(spec)
        writer = ShmWriter(ring_handle)
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", {"kind": spec.kind}))
    loop = _generation_loop if spec.kind == "generation" else _retrieval_loop
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        loop(runner, inbox, conn, writer)


def encode(msg: Any) -> bytes:
    """A message for a worker's inbox, pickled now (``pickle`` errors, a ``RecursionError``
    for data nested too deep, raise here, in the sender)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _send(conn: Any, msg: tuple, fallback: Any) -> None:
    """``conn.send(msg)``; if ``msg`` cannot be pickled, ``fallback()`` is sent instead."""
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        logger.error("a %r message cannot be pickled (%s); sending errors instead", msg[0], exc)
        data = pickle.dumps(fallback(f"the result cannot be sent back: {type(exc).__name__}"))
    conn.send_bytes(data)


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


def _drain(inbox: Any, block: bool) -> list[Any]:
    """Queued messages (waiting up to 0.5 s for one when ``block``); ``[None]`` (shut down)
    once the server process is gone, so a killed server leaves no orphan workers."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        return [None]
    msgs = []
    try:
        msgs.append(inbox.get(timeout=0.5) if block else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return [pickle.loads(m) if isinstance(m, bytes) else m for m in msgs]


def _generation_loop(runner: GenerationRunner, inbox: Any, conn: Any, writer: ShmWriter) -> None:
    was_busy = False
    last_stats = 0.0
    while True:
        updates = []
        for msg in _drain(inbox, block=not runner.has_work()):
            if msg is None:
                return
            if msg[0] == "gen":
                updates.extend(runner.add(msg[1]))
            elif msg[0] == "abort":
                runner.abort(msg[1])
            elif msg[0] == "call":
                _reply_call(conn, runner, *msg[1:])
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
            _send_generation(conn, writer, updates, stats)
        elif stats is not None:
            conn.send(("stats", stats))
        was_busy = busy


def _send_generation(
    conn: Any, writer: ShmWriter, updates: list, stats: dict | None = None
) -> None:
    """Token ids of all updates go into one shared-memory slot as ``lengths [n, 2]`` + ids;
    ``stats`` (the engine's, or ``None``) ride along."""
    prompts = [u.prompt_token_ids or () for u in updates]
    pairs = zip(prompts, updates, strict=True)
    lengths = np.array([[len(p), len(u.new_token_ids)] for p, u in pairs])
    flat = [t for p, u in zip(prompts, updates, strict=True) for t in (*p, *u.new_token_ids)]
    arrays = [lengths.astype(np.int64).reshape(-1, 2), np.asarray(flat, dtype=np.int64)]
    slim = [replace(u, new_token_ids=(), prompt_token_ids=None) for u in updates]
    ref = writer.write(arrays, timeout=1.0)
    conn.send(("gen", slim, ref if ref is not None else arrays, stats))


def unpack_generation(slim: list, arrays: list[np.ndarray]) -> list:
    """Inverse of ``_send_generation`` on the server side."""
    lengths, flat = arrays
    out, pos = [], 0
    for u, (num_prompt, num_new) in zip(slim, lengths.tolist(), strict=True):
        prompt = tuple(flat[pos : pos + num_prompt].tolist())
        new = tuple(flat[pos + num_prompt : pos + num_prompt + num_new].tolist())
        pos += num_prompt + num_new
        out.append(replace(u, new_token_ids=new, prompt_token_ids=prompt or None))
    return out


def _retrieval_loop(runner: RetrievalRunner, inbox: Any, conn: Any, writer: ShmWriter) -> None:
    del writer  # NOTE: the retrieval worker sends no arrays (see ``_send_retrieval``)
    while True:
        tasks = []
        pending = runner.has_pending()  # staged retrievals: next sub-stage, inbox drained first
        for msg in _drain(inbox, block=not pending):
            if msg is None:
                return
            if msg[0] == "ret":
                tasks.extend(msg[1])
            elif msg[0] == "call":
                _reply_call(conn, runner, *msg[1:])
        if tasks or pending:  # all tasks queued since the last search go out as one batch
            _send_retrieval(conn, runner, tasks)


def _reply_call(conn: Any, runner: Any, token: int, name: str, args: tuple) -> None:
    """Run ``runner.<name>(*args)`` and send its ``("reply", ...)``."""
    try:
        reply = ("reply", token, getattr(runner, name)(*args), None)
    except Exception as exc:
        logger.exception("call %s failed", name)
        reply = ("reply", token, None, (error_kind_of(exc), f"{type(exc).__name__}: {exc}"))
    _send(conn, reply, lambda err, t=token: ("reply", t, None, ("internal", err)))


def _send_retrieval(conn: Any, runner: RetrievalRunner, tasks: list) -> None:
    from ragserve.scheduler import RetrievalResult

    # NOTE: results carry their passages (ids, text, scores) in the message itself; the raw
    # id/score arrays are not sent, since nothing on the server side reads them.
    results = run_isolated(runner, tasks)

    def failed(err: str) -> tuple:
        return ("ret", [RetrievalResult(r.task_id, (), err) for r in results], None)

    _send(conn, ("ret", results, None), failed)
