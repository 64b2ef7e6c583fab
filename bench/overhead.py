"""Orchestration overhead (issue 16, OpRAG's point): per-node time outside the model, before and
after the typed Arrow data plane and tokenizer prefetch, side by side in one run.

Each side runs in its own process with its own ``ragserve`` source on ``PYTHONPATH`` (the
"before" source is ``git archive <rev> src``, default bc6b31c; or ``--before-src DIR``), on
the same data: a process-backend ``Server`` (default co-scheduling on) answers ``--num``
questions of the ``oneshot`` workflow (retrieve, then generate) one at a time (greedy: both
sides must give the same answers, or the run fails; ``overhead_side``). The worker processes
trace their model work (``overhead_trace``: model forward, query embedding, index scan) as
intervals of the system-wide monotonic clock; a request's model time is the part of its life
they cover.
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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_report import compare_rounds, report, summarize  # noqa: E402
from overhead_side import OVERHEAD_PRESETS, engine_options, run_side, serve_side  # noqa: E402
from overhead_trace import TRACE_ENV, trace_model_work  # noqa: E402
from rag_setup import prepare  # noqa: E402

logger = logging.getLogger("overhead")
REPO = Path(__file__).resolve().parent.parent
BEFORE = "bc6b31c"


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
    engine_options(args.engine_option, "")  # a malformed option fails here, not in a child
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
                    compare_rounds(result)
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


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(TRACE_ENV):
    # NOTE: ``spawn`` runs this script as ``__mp_main__`` in each worker before its target:
    # the one place to wrap the model work of either side's unmodified source.
    trace_model_work(os.environ[TRACE_ENV])
