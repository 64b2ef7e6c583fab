"""Where a node's time goes (``bench/overhead.py``): labelled ``(start, end, label)`` intervals
of the system-wide monotonic clock, recorded by wrapping each side's unmodified source (the
worker processes' model work and host phases, the server's scheduler thread), and read back
as model time (``covered``), a per-phase decomposition (``decompose``) and call counts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TRACE_ENV = "RAGSERVE_OVERHEAD_TRACE"
TRACE_FLUSH_S = 0.5  # a worker appends its new model-work intervals this often


def covered(intervals: list[list], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of the sorted "model" ``intervals``."""
    total, end = 0.0, lo
    for a, b, label in intervals:
        if label != "model":
            continue
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def scheduler_busy(clock: dict, timeout: float = 5.0) -> float:
    """Scheduler work so far (step minus poll/admission), read once the cycle running now
    and the next have ended: a cycle still running when a request's answer arrives has added
    its poll time but not yet its step time (an idle server's cycles take ``poll_timeout``)."""
    target, deadline = clock["steps"] + 2, time.monotonic() + timeout
    while clock["steps"] < target and time.monotonic() < deadline:
        time.sleep(0.001)
    return clock["step"] - clock["poll"]


def time_scheduler(server, profiler=None, intervals: list | None = None) -> dict:
    """Wrap the scheduler thread's step, poll and admission in wall-clock accumulators (and
    ``profiler``, a ``cProfile.Profile``, around each step); with ``intervals``, also record
    them there (step "sched_work", poll and admission "wait") and ``trace_server``'s."""
    clock = {"step": 0.0, "poll": 0.0, "steps": 0}
    if intervals is not None:
        trace_server(server, intervals)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0, m0 = time.perf_counter(), time.monotonic()
            try:
                return (
                    fn(*a, **kw)
                    if profiler is None or name != "step"
                    else (profiler.runcall(fn, *a, **kw))
                )
            finally:
                clock[name] += time.perf_counter() - t0
                clock["steps"] += name == "step"
                if intervals is not None:
                    label = "sched_work" if name == "step" else "wait"
                    intervals.append((m0, time.monotonic(), label))

        return wrapper

    server.executor.poll = timed("poll", server.executor.poll)
    server.scheduler._admit = timed("poll", server.scheduler._admit)
    server.scheduler.step = timed("step", server.scheduler.step)
    return clock


# The decomposition's buckets, in precedence order: where the traced intervals of several
# overlap (nested calls, or two processes at once), the first label that covers an instant
# owns it; an instant no traced work covers is "transit" (pipes, queues, wake-ups).
PHASES = (
    "model",  # model forward + sampling, query embedding, index scan
    "integrity_check",  # the KV block manager's check when the engine goes idle
    "engine_schedule",  # the engine's scheduler: batch, block tables
    "engine_postprocess",  # append tokens, detokenize, stop checks
    "engine_other",  # the rest of LLMEngine.step
    "runner",  # GenerationRunner.step outside the engine: admission, deltas
    "tokenize",  # prompt tokenization (prefetch thread or add_request)
    "engine_stats",  # LLMEngine.stats, once per update message
    "gen_send",  # building and sending a generation results message
    "retrieval_host",  # the retrieval worker's batch outside embedding/scan: docstore, results
    "ret_send",  # building and sending a retrieval results message
    "other_send",  # a worker's other pipe writes (engine stats alone, call replies)
    "worker_drain",  # a worker reading its inbox without waiting
    "sched_receive",  # the scheduler thread reading worker messages
    "sched_work",  # the scheduler thread's cycle outside poll/admission
    "server_add",  # Server._add in the caller's thread (graph, state, inbox)
)


def _traced(fn, label: str, intervals: list, clock=time.monotonic):
    def wrapper(*a, **kw):
        t0 = clock()
        try:
            return fn(*a, **kw)
        finally:
            intervals.append((t0, clock(), label))

    return wrapper


def _patch(owner, name: str, label: str, intervals: list) -> None:
    """Wrap ``owner.name`` (if the side's source has it) in a labelled interval."""
    if hasattr(owner, name):
        setattr(owner, name, _traced(getattr(owner, name), label, intervals))


def trace_model_work(trace_dir: str) -> None:
    """In a worker process: record ``(start, end, label)`` (``time.monotonic``, system-wide)
    of every model forward (``ModelRunner.execute_model``), embedding (``encode``) and index
    scan (``VectorIndex.search``, a staged sub-stage ``StagedSearch.step``), label "model",
    and of the worker's host work (``PHASES``: engine scheduling, postprocessing, runner,
    tokenization, stats, sends, inbox reads; patched by name where the side's source has
    them); appended as JSON lines to ``trace_dir/<pid>.jsonl`` every ``TRACE_FLUSH_S`` by a
    daemon thread and when the worker exits (so a live server's trace can be read,
    ``read_trace``)."""
    import threading
    from multiprocessing import connection, util

    from ragserve import retrieval
    from ragserve.generation import block_manager, kv_cache_manager, llm_engine
    from ragserve.generation import scheduler as gen_scheduler
    from ragserve.generation.model_runner import ModelRunner
    from ragserve.retrieval.index import VectorIndex
    from ragserve.retrieval.staged import StagedSearch
    from ragserve.runtime import runners, workers

    intervals: list[tuple[float, float, str]] = []
    for cls, name in ((ModelRunner, "execute_model"), (ModelRunner, "launch_model"),
                      (VectorIndex, "search"), (StagedSearch, "step")):  # fmt: skip
        _patch(cls, name, "model", intervals)
    trace_token_reads(intervals)
    engine = llm_engine.LLMEngine
    for owner, name, label in (
        (block_manager.BlockManager, "check_integrity", "integrity_check"),
        (
            getattr(kv_cache_manager, "TieredBlockManager", None),
            "check_integrity",
            "integrity_check",
        ),
        (gen_scheduler.Scheduler, "schedule", "engine_schedule"),
        (engine, "_postprocess", "engine_postprocess"),
        # NOTE: inside _postprocess on a synchronous step; an overlapped step advances its
        # computed tokens at launch, outside it: the same work under the same label either way
        (gen_scheduler.Scheduler, "update_after_step", "engine_postprocess"),
        (engine, "step", "engine_other"),
        (engine, "_tokenize", "tokenize"),
        (engine, "stats", "engine_stats"),
        (runners.GenerationRunner, "step", "runner"),
        (getattr(workers, "Outbox", None), "send_generation", "gen_send"),
        (workers, "_send_generation", "gen_send"),
        (workers, "run_isolated", "retrieval_host"),
        (getattr(workers, "Outbox", None), "send_retrieval", "ret_send"),
        (workers, "_send_retrieval", "ret_send"),
        (connection.Connection, "_send_bytes", "other_send"),
    ):
        _patch(owner, name, label, intervals)
    drain = workers._drain

    def traced_drain(inbox, block):
        t0 = time.monotonic()
        try:
            return drain(inbox, block)
        finally:
            if not block:  # NOTE: a blocking read is the worker waiting, not working
                intervals.append((t0, time.monotonic(), "worker_drain"))

    workers._drain = traced_drain
    load = retrieval.load_embedder

    def load_embedder(*a, **kw):
        embedder = load(*a, **kw)
        embedder.encode = _traced(embedder.encode, "model", intervals)
        return embedder

    retrieval.load_embedder = load_embedder
    out = Path(trace_dir) / f"{os.getpid()}.jsonl"
    lock, written = threading.Lock(), [0]

    def flush() -> None:
        with lock:  # NOTE: the thread and the exit hook never interleave their lines
            new = intervals[written[0] :]
            written[0] += len(new)
            if new:
                with out.open("a") as f:
                    f.write("".join(json.dumps(i) + "\n" for i in new))

    def flusher() -> None:
        while True:
            time.sleep(TRACE_FLUSH_S)
            flush()

    threading.Thread(target=flusher, name="overhead-trace", daemon=True).start()
    util.Finalize(None, flush, exitpriority=100)


def trace_token_reads(intervals: list, clock=time.monotonic) -> None:
    """Overlapped scheduling (a side without it has no ``SampledTokens``): a launched step's
    token read is model time (the wait for the device), and so is the gap since its launch if
    the device was still running it when the read began (``is_ready`` false then: the host
    work in the gap ran beside the forward)."""
    from ragserve.generation import model_runner

    cls = getattr(model_runner, "SampledTokens", None)
    if cls is None:
        return
    read = cls.tolist

    def traced(self):
        t0 = clock()
        busy = not self.is_ready()
        try:
            return read(self)
        finally:
            if busy:
                intervals.append((self.launched_at, t0, "model"))
            intervals.append((t0, clock(), "model"))

    cls.tolist = traced


def trace_server(server, intervals: list) -> None:
    """The server process's share of the decomposition: the scheduler thread's cycles
    (``sched_work``; its poll and admission, which wait, are recorded to be subtracted),
    its reads of worker messages (``sched_receive``) and ``Server._add``."""
    _patch(server.executor, "_receive", "sched_receive", intervals)
    _patch(server, "_add", "server_add", intervals)


def count_calls(intervals: list, lo: float, hi: float) -> dict[str, int]:
    """How many traced intervals of each label start in ``[lo, hi]`` (load-independent)."""
    out: dict[str, int] = {}
    for a, _, label in intervals:
        if lo <= a <= hi:
            out[label] = out.get(label, 0) + 1
    return out


def decompose(intervals: list, lo: float, hi: float) -> dict[str, float]:
    """Seconds of ``[lo, hi]`` owned by each label (``PHASES`` precedence; "wait" labels
    own nothing and cut "sched_work" out), the rest as "transit"."""
    rank = {label: i for i, label in enumerate(PHASES)}
    events = []
    for a, b, label in intervals:
        a, b = max(a, lo), min(b, hi)
        if b > a and (label in rank or label == "wait"):
            events += [(a, 1, label), (b, -1, label)]
    events.sort()
    active = dict.fromkeys([*PHASES, "wait"], 0)
    out = dict.fromkeys([*PHASES, "transit"], 0.0)
    t = lo
    for x, delta, label in events:
        if x > t:
            owner = next((p for p in PHASES if active[p] > 0), "transit")
            if owner == "sched_work" and active["wait"] > 0:
                owner = next((p for p in PHASES[rank["sched_work"] + 1 :] if active[p] > 0),
                             "transit")  # fmt: skip
            out[owner] += x - t
            t = x
        active[label] += delta
    out["transit"] += max(0.0, hi - t)
    return out


def read_trace(trace_dir: str) -> list[list[float]]:
    """Every worker's intervals so far, sorted (a line being written is skipped)."""
    intervals = []
    for f in Path(trace_dir).glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                intervals.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(intervals)
