"""Orchestration overhead (issue 16, OpRAG's point): per-node time outside the model, before and
after the typed Arrow data plane and tokenizer prefetch, side by side in one run.

Each side runs in its own process with its own ``ragserve`` source on ``PYTHONPATH`` (the
"before" source is ``git archive <rev> src``, default bc6b31c; or ``--before-src DIR``), on
the same data: a process-backend ``Server`` (default co-scheduling on) answers ``--num``
questions of the ``oneshot`` workflow (retrieve, then generate) one at a time (greedy: both
sides must give the same answers, or the run fails). The worker processes trace their model
work (``_trace_model_work``: model forward, query embedding, index scan) as intervals of the
system-wide monotonic clock; a request's model time is the part of its life they cover.
With the engine's overlapped scheduling (``enable_async_scheduling``) a step is launched
(``ModelRunner.launch_model``) and its tokens read later (``SampledTokens.tolist``): both are
model time, and so is the host work between them when the device was still running the step
at the read (host work hidden under the forward); when the step had already ended, that work
counts as orchestration (a conservative rule: the device's share of that gap is not counted).

    orchestration per node = (end-to-end - model time) / nodes    (everything but the model
        forward, the embedding and the index scan: scheduler, transforms, messages,
        serialization, queueing, tokenization, detokenization, the engine's own scheduling)
    scheduler work per node = scheduler thread's step time minus time blocked in poll/admission

    python bench/overhead.py --preset cpu --out /tmp/overhead_cpu.json
    python bench/overhead.py --preset h200 --out $OUT/overhead_h200.json   # ~3 min on one H200

``--concurrent N --num M`` does both on one server start per side (the compact device run):
both sides' servers up at once, first M + 1 oneshot questions one at a time with the sides
taking turns question by question, then the ``--rounds``; ``--time-budget`` stops asking and
the rounds early, and the JSON is rewritten after every question pair and every round.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rag_setup import CPU_SMALL_MODEL, H200_ENGINE, LLAMA_31_8B, PRESETS, prepare  # noqa: E402

logger = logging.getLogger("overhead")
TRACE_ENV = "RAGSERVE_OVERHEAD_TRACE"
TRACE_FLUSH_S = 0.5  # a worker appends its new model-work intervals this often
REPO = Path(__file__).resolve().parent.parent
BEFORE = "bc6b31c"

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


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(OVERHEAD_PRESETS), default="cpu")
    ap.add_argument("--num", type=int, default=None, help="questions per side (preset's default)")
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' source")
    ap.add_argument("--before-src", type=Path, default=None, help="its src/ folder instead")
    ap.add_argument("--data", type=Path, default=None, help="model/index folder (kept)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    ap.add_argument(
        "--concurrent",
        type=int,
        default=None,
        help="scheduler-work mode: rounds of this many concurrent requests",
    )
    ap.add_argument("--rounds", type=int, default=7, help="rounds per side (--concurrent)")
    ap.add_argument("--workflow", default="irg", help="workflow of --concurrent's requests")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="--concurrent: cProfile of the after side's scheduler thread here",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="the engine's KV cache (preset's by default; --concurrent runs two)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="--concurrent: no question (first 40 %%) or round started past this many seconds",
    )
    ap.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="SIDE:KEY=VALUE",
        help="an LLMEngine keyword for one side (VALUE as JSON), e.g. "
        "before:enable_async_scheduling=false (with --before-src src: this tree without overlap)",
    )
    ap.add_argument("--side", help=argparse.SUPPRESS)  # child mode: "before" | "after"
    args = ap.parse_args()  # fmt: skip
    _engine_options(args.engine_option, "")  # a malformed option fails here, not in a child
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.side and args.concurrent:
        serve_side(args)
        return
    if args.side:
        print(json.dumps(run_side(args)))
        return
    if args.concurrent:
        run_concurrent(args)
        return
    run_all(args)


def run_all(args) -> None:
    p = OVERHEAD_PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp) / "data"
        before = args.before_src or _export(args.before, Path(tmp) / "before")
        t0 = time.perf_counter()
        prepare(p, "synthetic", data)  # built once, by this (after) source
        sides = {}
        for side, src in (("before", before), ("after", REPO / "src")):
            sides[side] = _child(args, side, src, data)
            done = {k: v for k, v in summarize(sides[side]).items() if k != "src"}
            logger.info("side %s: %s", side, json.dumps(done))  # NOTE: kept if cut off later
    outputs = {side: [r.pop("output") for r in s["served"]] for side, s in sides.items()}
    if outputs["before"] != outputs["after"]:
        raise RuntimeError("the two sides answered differently: not the same model work")
    rows = {side: summarize(r) for side, r in sides.items()}
    result = {"preset": args.preset, "num": args.num or p.num_requests, "before": args.before,
              "wall_s": time.perf_counter() - t0, "sides": rows}  # fmt: skip
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def run_concurrent(args) -> None:
    """Scheduler work per node, before vs after, side by side: both sides' servers stay up
    (each in its own process) and take turns, ``--rounds`` rounds of ``--concurrent``
    requests each, the order alternating every round; the medians of the rounds compared.
    With ``--num``, first the sequential oneshot questions on the same servers
    (``ask_pairs``)."""
    p = OVERHEAD_PRESETS[args.preset]
    started = time.monotonic()
    deadline = started + args.time_budget if args.time_budget else None
    result = {"preset": args.preset, "concurrent": args.concurrent, "workflow": args.workflow,
              "before": args.before, "rounds": {"before": [], "after": []}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp) / "data"
        before = args.before_src or _export(args.before, Path(tmp) / "before")
        prepare(p, "synthetic", data)
        sides = {s: _server_child(args, s, src, data)
                 for s, src in (("before", before), ("after", REPO / "src"))}  # fmt: skip
        try:
            if args.num:
                ask_pairs(args, sides, result, deadline)
            for i in range(args.rounds + 1):  # the first round of each side warms it up
                if deadline is not None and time.monotonic() > deadline:
                    result["stopped"] = f"time budget spent before round {i}"
                    _write(args.out, result, started)
                    break
                for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    row = _command(sides[side], "round")
                    logger.info("round %d %s: %s", i, side, row)
                    if i > 0:
                        result["rounds"][side].append(row)
                if i > 0:
                    _compare_rounds(result)
                    _write(args.out, result, started)
        finally:
            for proc in sides.values():
                proc.stdin.close()
                proc.wait(timeout=120)
    _write(args.out, result, started)


def ask_pairs(args, sides: dict, result: dict, deadline: float | None) -> None:
    """``--num`` + 1 oneshot questions one at a time, the sides taking turns question by
    question (the order alternating; the first question, a warm-up, returns once both
    servers are up), then at most 40 % of the time budget left; then each side reads its
    workers' traces and the answers must agree."""
    start, stop, asked = time.monotonic(), None, 0
    for i in range(args.num + 1):
        if stop is not None and time.monotonic() > stop:
            result["sequential_stopped"] = f"time budget: {asked} of {args.num + 1} asked"
            _write(args.out, result, None)
            break
        e2e = {s: _command(sides[s], f"ask {i}")["e2e"]
               for s in (("before", "after") if i % 2 == 0 else ("after", "before"))}  # fmt: skip
        logger.info("question %d: e2e s %s", i, e2e)
        if i == 0 and deadline is not None:
            stop = time.monotonic() + 0.4 * (deadline - time.monotonic())
        asked = i + 1
        result["sequential_asked"] = asked
        _write(args.out, result, None)
    if asked < 2:
        return
    served = {side: _command(proc, "summary") for side, proc in sides.items()}
    outputs = {side: [r.pop("output") for r in s["served"]] for side, s in served.items()}
    same = [a == b for a, b in zip(outputs["before"], outputs["after"], strict=True)]
    # NOTE: recorded, not fatal here (the rounds still run): on a GPU in bf16 a near-tie can
    # flip a greedy token between two code versions without any orchestration difference
    result["answers_agreement"] = sum(same) / len(same)
    if not all(same):
        logger.warning("the sides answered %d of %d questions differently", len(same) - sum(same),
                       len(same))  # fmt: skip
    result["sides"] = {side: summarize(s) for side, s in served.items()}
    result["num"] = asked - 1
    result["wall_s"] = time.monotonic() - start
    print(report(result))
    _write(args.out, result, None)


def _command(proc: subprocess.Popen, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    if not answer:
        raise RuntimeError(f"the side's server exited (exit code {proc.poll()}) on {line!r}")
    return json.loads(answer)


def _compare_rounds(result: dict) -> None:
    """Medians of the rounds and the paired (same round) after / before ratios, with the
    sign test's one-sided p of "at least this many of n rounds at most half" if the paired
    ratio's median were 0.5."""
    rounds = result["rounds"]
    med = {s: 1e3 * statistics.median(r["scheduler_s_per_node"] for r in rows)
           for s, rows in rounds.items()}  # fmt: skip
    paired = [a["scheduler_s_per_node"] / b["scheduler_s_per_node"]
              for a, b in zip(rounds["after"], rounds["before"], strict=True)]  # fmt: skip
    n, k = len(paired), sum(r <= 0.5 for r in paired)
    result["median_ms_per_node"] = med
    result["after_over_before"] = med["after"] / med["before"]
    result["paired_ratios"] = paired
    result["rounds_at_most_half"] = k
    result["sign_test_p"] = sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n
    print(f"scheduler work per node, median of {n} rounds of {result['concurrent']} concurrent "
          f"{result['workflow']} requests: before {med['before']:.3f} ms, after "
          f"{med['after']:.3f} ms, after/before {result['after_over_before']:.2f}; paired ratio "
          f"<= 0.5 in {k} of {n} rounds (sign test p {result['sign_test_p']:.3f})",
          flush=True)  # fmt: skip


def _write(out: Path | None, result: dict, started: float | None) -> None:
    if started is not None:
        result["wall_s_total"] = time.monotonic() - started
    if out:
        out.write_text(json.dumps(result, indent=1))


def _server_child(args, side: str, src: Path, data: Path) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--preset", args.preset, "--side", side, "--data", str(data),
           "--concurrent", str(args.concurrent), "--workflow", args.workflow]  # fmt: skip
    cmd += ["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []
    cmd += ["--num", str(args.num)] if args.num else []  # the child traces its workers
    cmd += [f"--engine-option={o}" for o in args.engine_option]
    if args.profile and side == "after":
        cmd += ["--profile", str(args.profile)]
    logger.info("server %s from %s", side, src)
    return subprocess.Popen(cmd, env=_side_env(src), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


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
    config = _config(ServerConfig, args, data)
    make = getattr(builtin, args.workflow)
    kwargs = {"nprobe": data["nprobe"], "max_tokens": p.max_tokens}
    graph = make(topk=p.topk, **kwargs) if args.workflow == "oneshot" else make(**kwargs)
    single = builtin.oneshot(topk=p.topk, **kwargs)
    questions = data["questions"]
    profiler = cProfile.Profile() if args.profile else None
    trace = tempfile.TemporaryDirectory()
    if args.num:
        os.environ[TRACE_ENV] = trace.name  # NOTE: read by this module in the spawned workers
    asked: list = []
    with Server(data["model"], data["index"], config=config) as server:
        server_intervals: list = []
        clock = _timed(server, profiler, server_intervals if args.num else None)
        pool = ThreadPoolExecutor(args.concurrent)
        num_rounds = 0
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "ask":
                busy0 = _busy(clock)
                r = server.run(questions[int(rest[0]) % len(questions)], single)
                if r.error is not None:
                    raise RuntimeError(f"question {rest[0]} failed: {r.error}")
                asked.append((r, _busy(clock) - busy0))
                print(json.dumps({"e2e": r.latency}), flush=True)
                continue
            if command == "summary":
                time.sleep(3 * TRACE_FLUSH_S)  # the workers' last intervals flushed
                rows = _served([r for r, _ in asked], [b for _, b in asked], trace.name,
                               server_intervals)  # fmt: skip
                side = {"src": ragserve.__file__, "served": rows, "data_plane_us": data_plane_us()}
                print(json.dumps(side), flush=True)
                continue
            batch = [questions[(num_rounds * args.concurrent + j) % len(questions)]
                     for j in range(args.concurrent)]  # fmt: skip
            num_rounds += 1
            busy0, t0 = _busy(clock), time.perf_counter()
            responses = list(pool.map(lambda q: server.run(q, graph), batch))
            busy = _busy(clock) - busy0
            nodes = sum(len(r.node_timings) for r in responses)
            errors = [r.error for r in responses if r.error is not None]
            row = {"scheduler_s_per_node": busy / nodes, "nodes": nodes,
                   "errors": len(errors), "wall_s": time.perf_counter() - t0}  # fmt: skip
            print(json.dumps(row), flush=True)
        pool.shutdown()
    trace.cleanup()
    if profiler is not None:
        profiler.dump_stats(str(args.profile))


def _config(server_config: type, args, data: dict):
    """The side's ``ServerConfig``: the preset's engine (``--kv-cache-gib``), spawned workers
    (the model-work trace hooks in as ``__mp_main__``; a side without the field spawns)."""
    engine = dict(data["engine_kwargs"])
    if args.kv_cache_gib:
        engine["kv_cache_bytes"] = int(args.kv_cache_gib * (1 << 30))
    engine |= _engine_options(args.engine_option, args.side)
    kwargs = {"engine_kwargs": engine, "default_nprobe": data["nprobe"]}
    if "worker_start_method" in {f.name for f in fields(server_config)}:
        kwargs["worker_start_method"] = "spawn"
    return server_config(**kwargs)


def _engine_options(options: list[str], side: str) -> dict:
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


def _side_env(src: Path) -> dict:
    # NOTE: the side's source first; other entries (e.g. a --target site of wheels) kept
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    keep = [p for p in inherited if p and Path(p).resolve() != (REPO / "src").resolve()]
    path = os.pathsep.join([str(src), str(REPO / "bench"), *keep])
    return {**os.environ, "PYTHONPATH": path}


def _export(rev: str, out: Path) -> Path:
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def _child(args, side: str, src: Path, data: Path) -> dict:
    cmd = [sys.executable, __file__, "--preset", args.preset, "--side", side, "--data", str(data)]
    cmd += ["--num", str(args.num)] if args.num else []
    cmd += ["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []
    cmd += [f"--engine-option={o}" for o in args.engine_option]
    logger.info("side %s from %s", side, src)
    out = subprocess.run(cmd, env=_side_env(src), check=True, stdout=subprocess.PIPE,
                         text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def run_side(args) -> dict:
    """One side: the questions served one at a time; the workers trace their model work."""
    import ragserve
    from ragserve.runtime import Server, ServerConfig
    from ragserve.workflows.builtin import oneshot

    p = OVERHEAD_PRESETS[args.preset]
    data = prepare(p, "synthetic", args.data)
    num = args.num or p.num_requests
    questions = data["questions"][: num + 1]
    config = _config(ServerConfig, args, data)
    graph = oneshot(topk=p.topk, nprobe=data["nprobe"], max_tokens=p.max_tokens)
    data_plane = data_plane_us()
    responses, busy = [], []
    with tempfile.TemporaryDirectory() as trace:
        os.environ[TRACE_ENV] = trace  # NOTE: read by this module in the spawned workers
        with Server(data["model"], data["index"], config=config) as server:
            server_intervals: list = []
            clock = _timed(server, intervals=server_intervals)
            for q in questions:
                busy0 = _busy(clock)
                r = server.run(q, graph)
                busy.append(_busy(clock) - busy0)
                if r.error is not None:
                    raise RuntimeError(f"{q!r} failed: {r.error}")
                responses.append(r)
        served = _served(responses, busy, trace, server_intervals)
    return {"src": ragserve.__file__, "served": served, "data_plane_us": data_plane}


def _served(
    responses: list, busy: list[float], trace_dir: str, server_intervals: list
) -> list[dict]:
    """Per question (the first, a warm-up, dropped): end to end, nodes, scheduler work, the
    answer, the model time (the part of its life the workers' traced intervals cover) and
    its decomposition (``decompose``: the workers' and the server's labelled intervals)."""
    intervals = sorted(_read_trace(trace_dir) + [list(i) for i in server_intervals])
    if not intervals:
        raise RuntimeError("the workers traced no model work")
    return [
        {
            "e2e": r.latency,
            "nodes": len(r.node_timings),
            "scheduler": b,
            "output": r.output,
            "model": _covered(intervals, r.arrival_time, r.finish_time),
            "phases": decompose(intervals, r.arrival_time, r.finish_time),
            "calls": _calls(intervals, r.arrival_time, r.finish_time),
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
        from ragserve.runtime.payloads import read_results

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


def _covered(intervals: list[list], lo: float, hi: float) -> float:
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


def _busy(clock: dict, timeout: float = 5.0) -> float:
    """Scheduler work so far (step minus poll/admission), read once the cycle running now
    and the next have ended: a cycle still running when a request's answer arrives has added
    its poll time but not yet its step time (an idle server's cycles take ``poll_timeout``)."""
    target, deadline = clock["steps"] + 2, time.monotonic() + timeout
    while clock["steps"] < target and time.monotonic() < deadline:
        time.sleep(0.001)
    return clock["step"] - clock["poll"]


def _timed(server, profiler=None, intervals: list | None = None) -> dict:
    """Wrap the scheduler thread's step, poll and admission in wall-clock accumulators (and
    ``profiler``, a ``cProfile.Profile``, around each step); with ``intervals``, also record
    them there (step "sched_work", poll and admission "wait") and ``_trace_server``'s."""
    clock = {"step": 0.0, "poll": 0.0, "steps": 0}
    if intervals is not None:
        _trace_server(server, intervals)

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


def _trace_model_work(trace_dir: str) -> None:
    """In a worker process: record ``(start, end, label)`` (``time.monotonic``, system-wide)
    of every model forward (``ModelRunner.execute_model``), embedding (``encode``) and index
    scan (``VectorIndex.search``, a staged sub-stage ``StagedSearch.step``), label "model",
    and of the worker's host work (``PHASES``: engine scheduling, postprocessing, runner,
    tokenization, stats, sends, inbox reads; patched by name where the side's source has
    them); appended as JSON lines to ``trace_dir/<pid>.jsonl`` every ``TRACE_FLUSH_S`` by a
    daemon thread and when the worker exits (so a live server's trace can be read,
    ``_read_trace``)."""
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
    _trace_token_reads(intervals)
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


def _trace_token_reads(intervals: list, clock=time.monotonic) -> None:
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


def _trace_server(server, intervals: list) -> None:
    """The server process's share of the decomposition: the scheduler thread's cycles
    (``sched_work``; its poll and admission, which wait, are recorded to be subtracted),
    its reads of worker messages (``sched_receive``) and ``Server._add``."""
    _patch(server.executor, "_receive", "sched_receive", intervals)
    _patch(server, "_add", "server_add", intervals)


def _calls(intervals: list, lo: float, hi: float) -> dict[str, int]:
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


def _read_trace(trace_dir: str) -> list[list[float]]:
    """Every worker's intervals so far, sorted (a line being written is skipped)."""
    intervals = []
    for f in Path(trace_dir).glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                intervals.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(intervals)


def summarize(side: dict) -> dict:
    served = side["served"]
    e2e = sum(r["e2e"] for r in served)
    nodes = sum(r["nodes"] for r in served)
    orchestration = [r["e2e"] - r["model"] for r in served]
    model = [r["model"] for r in served]
    n, share = len(served), sum(orchestration) / e2e
    # the ratio of sums' standard error (delta method over the questions)
    residuals = [o - share * r["e2e"] for o, r in zip(orchestration, served, strict=True)]
    se = (sum(d * d for d in residuals) / (n * (n - 1))) ** 0.5 * n / e2e if n > 1 else None
    return {
        "src": side["src"],
        "e2e_s_mean": e2e / len(served),
        "model_s_mean": sum(model) / len(model),
        "orchestration_ms_per_node": 1e3 * sum(orchestration) / nodes,
        "orchestration_ms_per_node_median": 1e3
        * statistics.median(orchestration)
        * len(served)
        / nodes,
        "orchestration_share": share,
        "orchestration_share_se": se,
        "num_questions": n,
        "scheduler_ms_per_node": 1e3 * sum(r["scheduler"] for r in served) / nodes,
        "data_plane_us": side["data_plane_us"],
        "phases_ms_per_node": {
            k: 1e3 * sum(r["phases"][k] for r in served) / nodes for k in served[0]["phases"]
        }
        if "phases" in served[0]
        else None,
        "calls_per_node": {
            k: sum(r["calls"].get(k, 0) for r in served) / nodes
            for k in ("gen_send", "sched_receive", "sched_work", "engine_stats")
        }
        if "calls" in served[0]
        else None,
    }


def report(result: dict) -> str:
    lines = [f"preset {result['preset']}, {result['num']} oneshot questions per side, "
             f"before = {result['before']}, {result['wall_s']:.0f} s",
             "| side | e2e mean s | model mean s | orchestration ms/node (median) "
             "| orchestration share | scheduler work ms/node | message us: generation "
             "/ retrieval |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for side, r in result["sides"].items():
        lines.append(
            f"| {side} | {r['e2e_s_mean']:.3f} | {r['model_s_mean']:.3f} | "
            f"{r['orchestration_ms_per_node']:.2f} ({r['orchestration_ms_per_node_median']:.2f})"
            f" | {100 * r['orchestration_share']:.1f} % | {r['scheduler_ms_per_node']:.2f} | "
            f"{r['data_plane_us']['generation']:.0f} / {r['data_plane_us']['retrieval']:.0f} |"
        )
    for side, r in result["sides"].items():
        if r.get("orchestration_share_se") is not None:
            lines.append(f"{side}: orchestration share {100 * r['orchestration_share']:.2f} % "
                         f"+- {100 * r['orchestration_share_se']:.2f} % (1 s.e., "
                         f"{r['num_questions']} questions)")  # fmt: skip
    phases = {side: r["phases_ms_per_node"] for side, r in result["sides"].items()
              if r.get("phases_ms_per_node")}  # fmt: skip
    if phases:
        lines += ["where a node's time goes (ms per node; model = forward + sampling, "
                  "embedding, scan; transit = no traced work: pipes, queues, wake-ups):",
                  "| phase | " + " | ".join(phases) + " |",
                  "| --- |" + " --- |" * len(phases)]  # fmt: skip
        for k in next(iter(phases.values())):
            lines.append(f"| {k} | " + " | ".join(f"{p[k]:.3f}" for p in phases.values()) + " |")
    for side, r in result["sides"].items():
        if r.get("calls_per_node"):
            calls = ", ".join(f"{k} {v:.1f}" for k, v in r["calls_per_node"].items())
            lines.append(f"{side}: calls per node: {calls} (sched_work = scheduler cycles)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(TRACE_ENV):
    # NOTE: ``spawn`` runs this script as ``__mp_main__`` in each worker before its target:
    # the one place to wrap the model work of either side's unmodified source.
    _trace_model_work(os.environ[TRACE_ENV])
