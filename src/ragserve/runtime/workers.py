"""The persistent worker processes: one owns the LLM engine, one the embedder and the index.

Each worker reads messages from its bounded inbox (``multiprocessing.Queue``), writes results
to its own pipe, and puts numpy arrays (token ids, search ids/scores) in the shared-memory
ring instead of pickling them. Messages in:

    ("gen", [GenerationTask])   ("abort", [task_id])          generation worker
    ("ret", [RetrievalTask])    ("call", token, name, args)   retrieval worker
    None                                                      shut down

Messages out: ("ready", info), ("fatal", traceback), ("gen", updates, ShmRef | arrays,
stats | None), ("stats", stats), ("ret", results, ShmRef | arrays), ("reply", token, value,
error).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ragserve.runtime.runners import GenerationRunner, RetrievalRunner
from ragserve.runtime.shm import ShmRef, ShmWriter

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
    log_level: int = logging.WARNING  # of the ``ragserve`` loggers (the parent's, by default)


def build_runner(spec: WorkerSpec) -> GenerationRunner | RetrievalRunner:
    if spec.kind == "generation":
        from ragserve.generation import LLMEngine

        return GenerationRunner(LLMEngine(spec.model, **dict(spec.engine_kwargs)))
    from ragserve.retrieval import VectorIndex, load_embedder
    from ragserve.runtime.staged_retrieval import StagedRetrievalRunner

    index = VectorIndex.load(spec.index)
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
    return msgs


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
    while True:
        tasks = []
        pending = runner.has_pending()  # staged retrievals: next sub-stage, inbox drained first
        for msg in _drain(inbox, block=not pending):
            if msg is None:
                return
            if msg[0] == "ret":
                tasks.extend(msg[1])
            elif msg[0] == "call":
                _, token, name, args = msg
                try:
                    conn.send(("reply", token, getattr(runner, name)(*args), None))
                except Exception as exc:
                    conn.send(("reply", token, None, f"{type(exc).__name__}: {exc}"))
        if tasks or pending:  # all tasks queued since the last search go out as one batch
            _send_retrieval(conn, writer, runner, tasks)


def _send_retrieval(conn: Any, writer: ShmWriter, runner: RetrievalRunner, tasks: list) -> None:
    from ragserve.scheduler import RetrievalResult

    try:
        results, ids, scores = runner.run(tasks)
    except Exception as exc:
        logger.exception("retrieval batch failed")
        err = f"{type(exc).__name__}: {exc}"
        conn.send(("ret", [RetrievalResult(t.task_id, (), err) for t in tasks], None))
        return
    ref: ShmRef | None = writer.write([ids, scores], timeout=1.0) if ids.size else None
    conn.send(("ret", results, ref if ref is not None else [ids, scores]))
