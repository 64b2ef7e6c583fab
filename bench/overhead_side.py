"""One side of ``bench/overhead.py`` (its own process, its own ``ragserve`` source first on
``PYTHONPATH``): a process-backend ``Server`` answering the questions one at a time
(``run_side``) or the driver's commands on stdin (``serve_side``), the workers' model work
traced (``overhead_trace``); and the data plane's message cost (``data_plane_us``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import fields, replace

from overhead_trace import (
    TRACE_ENV,
    TRACE_FLUSH_S,
    count_calls,
    covered,
    decompose,
    read_trace,
    scheduler_busy,
    time_scheduler,
)
from rag_setup import CPU_SMALL_MODEL, H200_ENGINE, LLAMA_31_8B, PRESETS, prepare

OVERHEAD_PRESETS = {
    "cpu": replace(
        PRESETS["smoke"],
        model=CPU_SMALL_MODEL,
        num_docs=20_000,
        dim=64,
        nlist=64,
        nprobes=(16,),
        num_topics=256,
        max_tokens=16,
        topk=3,
        num_requests=24,
    ),
    "h200": replace(
        PRESETS["h200-smoke"],
        model=LLAMA_31_8B,
        engine=H200_ENGINE,
        num_docs=200_000,
        max_tokens=32,
        topk=3,
        num_requests=24,
    ),
}


def serve_side(args) -> None:
    """A ``--concurrent`` child: one server answering lines on stdin, one JSON line each:
    ``round`` runs one round of ``--concurrent`` requests (scheduler seconds per node, nodes,
    errors, wall seconds); ``ask I`` (with ``--num``) answers question I alone, traced like
    ``run_side``; ``summary`` returns what ``run_side`` returns for the questions asked."""
    import cProfile
    from concurrent.futures import ThreadPoolExecutor

    import ragserve
    from ragserve.runtime import Server, ServerConfig
    from ragserve.workflows import builtin

    p = OVERHEAD_PRESETS[args.preset]
    data = prepare(p, "synthetic", args.data)
    config = side_config(ServerConfig, args, data)
    make = getattr(builtin, args.workflow)
    kwargs = {"nprobe": data["nprobe"], "max_tokens": p.max_tokens}
    graph = make(topk=p.topk, **kwargs) if args.workflow == "oneshot" else make(**kwargs)
    single = builtin.oneshot(topk=p.topk, **kwargs)
    questions = data["questions"]
    profiler = cProfile.Profile() if args.profile else None
    trace = tempfile.TemporaryDirectory()
    if args.num:
        os.environ[TRACE_ENV] = (
            trace.name
        )  # NOTE: read by overhead.py, the spawned workers' __mp_main__
    asked: list = []
    with Server(data["model"], data["index"], config=config) as server:
        server_intervals: list = []
        clock = time_scheduler(server, profiler, server_intervals if args.num else None)
        pool = ThreadPoolExecutor(args.concurrent)
        num_rounds = 0
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "ask":
                busy0 = scheduler_busy(clock)
                r = server.run(questions[int(rest[0]) % len(questions)], single)
                if r.error is not None:
                    raise RuntimeError(f"question {rest[0]} failed: {r.error}")
                asked.append((r, scheduler_busy(clock) - busy0))
                print(json.dumps({"e2e": r.latency}), flush=True)
                continue
            if command == "summary":
                time.sleep(3 * TRACE_FLUSH_S)  # the workers' last intervals flushed
                rows = served_rows([r for r, _ in asked], [b for _, b in asked], trace.name,
                               server_intervals)  # fmt: skip
                side = {"src": ragserve.__file__, "served": rows, "data_plane_us": data_plane_us()}
                print(json.dumps(side), flush=True)
                continue
            batch = [questions[(num_rounds * args.concurrent + j) % len(questions)]
                     for j in range(args.concurrent)]  # fmt: skip
            num_rounds += 1
            busy0, t0 = scheduler_busy(clock), time.perf_counter()
            responses = list(pool.map(lambda q: server.run(q, graph), batch))
            busy = scheduler_busy(clock) - busy0
            nodes = sum(len(r.node_timings) for r in responses)
            errors = [r.error for r in responses if r.error is not None]
            row = {"scheduler_s_per_node": busy / nodes, "nodes": nodes,
                   "errors": len(errors), "wall_s": time.perf_counter() - t0}  # fmt: skip
            print(json.dumps(row), flush=True)
        pool.shutdown()
    trace.cleanup()
    if profiler is not None:
        profiler.dump_stats(str(args.profile))


def side_config(server_config: type, args, data: dict):
    """The side's ``ServerConfig``: the preset's engine (``--kv-cache-gib``), spawned workers
    (the model-work trace hooks in as ``__mp_main__``; a side without the field spawns)."""
    engine = dict(data["engine_kwargs"])
    if args.kv_cache_gib:
        engine["kv_cache_bytes"] = int(args.kv_cache_gib * (1 << 30))
    engine |= engine_options(args.engine_option, args.side)
    kwargs = {"engine_kwargs": engine, "default_nprobe": data["nprobe"]}
    if "worker_start_method" in {f.name for f in fields(server_config)}:
        kwargs["worker_start_method"] = "spawn"
    return server_config(**kwargs)


def engine_options(options: list[str], side: str) -> dict:
    """``SIDE:KEY=VALUE`` items (``--engine-option``) for ``side``; VALUE is JSON."""
    out = {}
    for item in options:
        where, _, pair = item.partition(":")
        key, eq, value = pair.partition("=")
        if where not in ("before", "after") or not key or not eq:
            raise SystemExit(f"--engine-option wants SIDE:KEY=VALUE (SIDE before|after): {item!r}")
        try:
            parsed = json.loads(value)
        except ValueError:
            raise SystemExit(f"--engine-option {item!r}: VALUE is not JSON") from None
        if where == side:
            out[key] = parsed
    return out


def run_side(args) -> dict:
    """One side: the questions served one at a time; the workers trace their model work."""
    import ragserve
    from ragserve.runtime import Server, ServerConfig
    from ragserve.workflows.builtin import oneshot

    p = OVERHEAD_PRESETS[args.preset]
    data = prepare(p, "synthetic", args.data)
    num = args.num or p.num_requests
    questions = data["questions"][: num + 1]
    config = side_config(ServerConfig, args, data)
    graph = oneshot(topk=p.topk, nprobe=data["nprobe"], max_tokens=p.max_tokens)
    data_plane = data_plane_us()
    responses, busy = [], []
    with tempfile.TemporaryDirectory() as trace:
        os.environ[TRACE_ENV] = trace  # NOTE: read by overhead.py, the spawned workers' __mp_main__
        with Server(data["model"], data["index"], config=config) as server:
            server_intervals: list = []
            clock = time_scheduler(server, intervals=server_intervals)
            for q in questions:
                busy0 = scheduler_busy(clock)
                r = server.run(q, graph)
                busy.append(scheduler_busy(clock) - busy0)
                if r.error is not None:
                    raise RuntimeError(f"{q!r} failed: {r.error}")
                responses.append(r)
        served = served_rows(responses, busy, trace, server_intervals)
    return {"src": ragserve.__file__, "served": served, "data_plane_us": data_plane}


def served_rows(
    responses: list, busy: list[float], trace_dir: str, server_intervals: list
) -> list[dict]:
    """Per question (the first, a warm-up, dropped): end to end, nodes, scheduler work, the
    answer, the model time (the part of its life the workers' traced intervals cover) and
    its decomposition (``decompose``: the workers' and the server's labelled intervals)."""
    intervals = sorted(read_trace(trace_dir) + [list(i) for i in server_intervals])
    if not intervals:
        raise RuntimeError("the workers traced no model work")
    return [
        {
            "e2e": r.latency,
            "nodes": len(r.node_timings),
            "scheduler": b,
            "output": r.output,
            "model": covered(intervals, r.arrival_time, r.finish_time),
            "phases": decompose(intervals, r.arrival_time, r.finish_time),
            "calls": count_calls(intervals, r.arrival_time, r.finish_time),
        }  # fmt: skip
        for r, b in zip(responses[1:], busy[1:], strict=True)
    ]


def data_plane_us(repeats: int = 300) -> dict[str, float]:
    """Best-of-``repeats`` microseconds for one results message to cross (worker side: build
    and send into a pipe stand-in and the ring; server side: receive and decode), for a
    generation step of 64 updates (one with a 400-token prompt) and a retrieval batch of 32
    results x 3 passages of ~650 characters. Feature-detects the side's data plane."""
    import pickle

    from ragserve.graph import Passage
    from ragserve.runtime import workers
    from ragserve.runtime.shm import ShmRing, ShmWriter
    from ragserve.scheduler import GenerationUpdate, RetrievalResult

    text = "lorem ipsum dolor sit amet " * 24
    results = [RetrievalResult(f"t{i}", tuple(Passage(f"d{i}-{j}", f"{i}.{j} {text}", "Title",
               0.5 + j) for j in range(3))) for i in range(32)]  # fmt: skip
    updates = [GenerationUpdate(f"g{i}", " tok", (1234,), False) for i in range(63)]
    updates.append(GenerationUpdate("p", "a", (7,), False, prompt_token_ids=tuple(range(400))))

    class Pipe:
        def send_bytes(self, data: bytes) -> None:
            self.data = data

        def send(self, msg) -> None:
            self.data = pickle.dumps(msg)

    pipe = Pipe()
    if hasattr(workers, "Outbox"):  # after: typed messages, rows pickled or Arrow by size
        from ragserve.runtime import ServerConfig
        from ragserve.runtime.wire import read_results

        config = ServerConfig()
        ring = ShmRing(4, config.shm_slot_bytes)
        writer = ShmWriter(ring.handle())
        outbox = workers.Outbox(pipe, writer, config.max_message_bytes, config.small_message_bytes)

        def gen() -> None:
            outbox.send_generation(updates, None)
            read_results(pickle.loads(pipe.data), ring)

        def ret() -> None:
            outbox.send_retrieval(results)
            read_results(pickle.loads(pipe.data), ring)
    else:  # before: positional tuples, numpy token ids in the ring, pickled passages
        import multiprocessing as mp

        ring = ShmRing(mp.get_context("spawn"), 4, 1 << 20)
        writer = ShmWriter(ring.handle())

        def gen() -> None:
            workers._send_generation(pipe, writer, updates, None)
            _, slim, ref, _ = pickle.loads(pipe.data)
            workers.unpack_generation(slim, ring.read(ref))

        def ret() -> None:
            workers._send(pipe, ("ret", results, None), None)
            pickle.loads(pipe.data)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * min(times)

    out = {"generation": best(gen), "retrieval": best(ret)}
    ring.close()
    return out
