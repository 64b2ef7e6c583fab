"""Orchestration overhead (issue 16, OpRAG's point): per-node time outside the model, before and
after the typed Arrow data plane and tokenizer prefetch, side by side in one run.

Each side runs in its own process with its own ``ragserve`` source on ``PYTHONPATH`` (the
"before" source is ``git archive <rev> src``, default bc6b31c; or ``--before-src DIR``), on
the same data: a process-backend ``Server`` (default co-scheduling on) answers ``--num``
questions of the ``oneshot`` workflow (retrieve, then generate) one at a time (greedy: both
sides must give the same answers, or the run fails). The worker processes trace their model
work (``_trace_model_work``: model forward, query embedding, index scan) as intervals of the
system-wide monotonic clock; a request's model time is the part of its life they cover.

    orchestration per node = (end-to-end - model time) / nodes    (everything but the model
        forward, the embedding and the index scan: scheduler, transforms, messages,
        serialization, queueing, tokenization, detokenization, the engine's own scheduling)
    scheduler work per node = scheduler thread's step time minus time blocked in poll/admission

    python bench/overhead.py --preset cpu --out /tmp/overhead_cpu.json
    python bench/overhead.py --preset h200 --out $OUT/overhead_h200.json   # ~3 min on one H200
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rag_setup import CPU_SMALL_MODEL, H200_ENGINE, LLAMA_31_8B, PRESETS, prepare  # noqa: E402

logger = logging.getLogger("overhead")
TRACE_ENV = "RAGSERVE_OVERHEAD_TRACE"
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(OVERHEAD_PRESETS), default="cpu")
    ap.add_argument("--num", type=int, default=None, help="questions per side (preset's default)")
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' source")
    ap.add_argument("--before-src", type=Path, default=None, help="its src/ folder instead")
    ap.add_argument("--data", type=Path, default=None, help="model/index folder (kept)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # child mode: "before" | "after"
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.side:
        print(json.dumps(run_side(args)))
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
    outputs = {side: [r.pop("output") for r in s["served"]] for side, s in sides.items()}
    if outputs["before"] != outputs["after"]:
        raise RuntimeError("the two sides answered differently: not the same model work")
    rows = {side: summarize(r) for side, r in sides.items()}
    result = {"preset": args.preset, "num": args.num or p.num_requests, "before": args.before,
              "wall_s": time.perf_counter() - t0, "sides": rows}  # fmt: skip
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def _export(rev: str, out: Path) -> Path:
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def _child(args, side: str, src: Path, data: Path) -> dict:
    cmd = [sys.executable, __file__, "--preset", args.preset, "--side", side, "--data", str(data)]
    cmd += ["--num", str(args.num)] if args.num else []
    # NOTE: the side's source first; other entries (e.g. a --target site of wheels) kept
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    keep = [p for p in inherited if p and Path(p).resolve() != (REPO / "src").resolve()]
    path = os.pathsep.join([str(src), str(REPO / "bench"), *keep])
    env = {**os.environ, "PYTHONPATH": path}
    logger.info("side %s from %s", side, src)
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
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
    config = ServerConfig(engine_kwargs=data["engine_kwargs"], default_nprobe=data["nprobe"])
    graph = oneshot(topk=p.topk, nprobe=data["nprobe"], max_tokens=p.max_tokens)
    data_plane = data_plane_us()
    responses, busy = [], []
    with tempfile.TemporaryDirectory() as trace:
        os.environ[TRACE_ENV] = trace  # NOTE: read by this module in the spawned workers
        with Server(data["model"], data["index"], config=config) as server:
            clock = _timed(server)
            for q in questions:
                busy0 = clock["step"] - clock["poll"]
                r = server.run(q, graph)
                busy.append(clock["step"] - clock["poll"] - busy0)
                if r.error is not None:
                    raise RuntimeError(f"{q!r} failed: {r.error}")
                responses.append(r)
        intervals = sorted(i for f in Path(trace).glob("*.json") for i in json.loads(f.read_text()))
    if not intervals:
        raise RuntimeError("the workers traced no model work")
    served = [
        {
            "e2e": r.latency,
            "nodes": len(r.node_timings),
            "scheduler": b,
            "output": r.output,
            "model": _covered(intervals, r.arrival_time, r.finish_time),
        }  # fmt: skip
        for r, b in zip(responses[1:], busy[1:], strict=True)  # the first is a warm-up
    ]
    return {"src": ragserve.__file__, "served": served, "data_plane_us": data_plane}


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
    results = [RetrievalResult(f"t{i}", tuple(Passage(f"d{i}-{j}", text, "Title", 0.5 + j)
               for j in range(3))) for i in range(32)]  # fmt: skip
    updates = [GenerationUpdate(f"g{i}", " tok", (1234,), False) for i in range(63)]
    updates.append(GenerationUpdate("p", "a", (7,), False, prompt_token_ids=tuple(range(400))))

    class Pipe:
        def send_bytes(self, data: bytes) -> None:
            self.data = data

        def send(self, msg) -> None:
            self.data = pickle.dumps(msg)

    pipe = Pipe()
    if hasattr(workers, "Outbox"):  # after: typed messages, Arrow payloads
        from ragserve.runtime.arrow_batches import attach_retrieval, read_generation

        ring = ShmRing(4, 1 << 20)
        outbox = workers.Outbox(pipe, ShmWriter(ring.handle()), 1 << 28)

        def gen() -> None:
            outbox.send_generation(updates, None)
            msg = pickle.loads(pipe.data)
            with ring.read(msg.payload) as batch:
                read_generation(msg.task_ids, batch)
                del batch

        def ret() -> None:
            outbox.send_retrieval(results)
            msg = pickle.loads(pipe.data)
            with ring.read(msg.payload) as batch:
                attach_retrieval(msg.results, batch)
                del batch
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


def _covered(intervals: list[list[float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of the sorted ``intervals``."""
    total, end = 0.0, lo
    for a, b in intervals:
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _timed(server) -> dict:
    """Wrap the scheduler thread's step, poll and admission in wall-clock accumulators."""
    clock = {"step": 0.0, "poll": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[name] += time.perf_counter() - t0

        return wrapper

    server.executor.poll = timed("poll", server.executor.poll)
    server.scheduler._admit = timed("poll", server.scheduler._admit)
    server.scheduler.step = timed("step", server.scheduler.step)
    return clock


def _trace_model_work(trace_dir: str) -> None:
    """In a worker process: record ``(start, end)`` (``time.monotonic``, system-wide) of every
    model forward (``ModelRunner.execute_model``), embedding (``encode``) and index scan
    (``VectorIndex.search``, a staged sub-stage ``StagedSearch.step``); written to
    ``trace_dir/<pid>.json`` when the worker exits."""
    from multiprocessing import util

    from ragserve import retrieval
    from ragserve.generation.model_runner import ModelRunner
    from ragserve.retrieval.index import VectorIndex
    from ragserve.retrieval.staged import StagedSearch

    intervals: list[tuple[float, float]] = []

    def traced(fn):
        def wrapper(*a, **kw):
            t0 = time.monotonic()
            try:
                return fn(*a, **kw)
            finally:
                intervals.append((t0, time.monotonic()))

        return wrapper

    for cls, name in ((ModelRunner, "execute_model"), (VectorIndex, "search"),
                      (StagedSearch, "step")):  # fmt: skip
        setattr(cls, name, traced(getattr(cls, name)))
    load = retrieval.load_embedder

    def load_embedder(*a, **kw):
        embedder = load(*a, **kw)
        embedder.encode = traced(embedder.encode)
        return embedder

    retrieval.load_embedder = load_embedder
    out = Path(trace_dir) / f"{os.getpid()}.json"
    util.Finalize(None, lambda: out.write_text(json.dumps(intervals)), exitpriority=100)


def summarize(side: dict) -> dict:
    served = side["served"]
    e2e = sum(r["e2e"] for r in served)
    nodes = sum(r["nodes"] for r in served)
    orchestration = [r["e2e"] - r["model"] for r in served]
    model = [r["model"] for r in served]
    return {
        "src": side["src"],
        "e2e_s_mean": e2e / len(served),
        "model_s_mean": sum(model) / len(model),
        "orchestration_ms_per_node": 1e3 * sum(orchestration) / nodes,
        "orchestration_ms_per_node_median": 1e3
        * statistics.median(orchestration)
        * len(served)
        / nodes,
        "orchestration_share": sum(orchestration) / e2e,
        "scheduler_ms_per_node": 1e3 * sum(r["scheduler"] for r in served) / nodes,
        "data_plane_us": side["data_plane_us"],
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(TRACE_ENV):
    # NOTE: ``spawn`` runs this script as ``__mp_main__`` in each worker before its target:
    # the one place to wrap the model work of either side's unmodified source.
    _trace_model_work(os.environ[TRACE_ENV])
