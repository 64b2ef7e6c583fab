"""``ragserve demo``: the embedded default end to end: factbook questions through all five
built-in workflows at once (models and index built on the first run); answers, sources and a
timing table printed."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from ragserve.cli.options import add_server_args, build_server

QUESTIONS = (
    "What is the capital of France?",
    "What currency is used in Kenya?",
    "What languages are spoken in Peru?",
    "What is the capital of Japan?",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run factbook questions through all five workflows")
    p.add_argument("--questions", type=int, default=2, help=f"how many (1-{len(QUESTIONS)})")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length bound")
    p.add_argument("--topk", type=int, default=2, help="passages per retrieval")
    add_server_args(p)
    p.set_defaults(func=handler)


# NOTE: a small context and KV pool keep the CPU engine fast on short RAG prompts (a config
# file or the flags override them); a CPU with native bf16 runs the LLM in bf16 (BENCHMARKS.md).
DEMO_ENGINE = {"kv_cache_bytes": 192 << 20, "max_model_len": 2048}


def demo_workflows(max_tokens: int, topk: int) -> dict[str, Any]:
    """The five workflows with short generations (so the demo runs quickly on a CPU)."""
    from ragserve.workflows import get_workflow

    short = max(8, max_tokens // 2)
    common = {"max_tokens": max_tokens, "topk": topk}
    return {
        "oneshot": get_workflow("oneshot", **common),
        "hyde": get_workflow("hyde", hypo_tokens=short, **common),
        "multistep": get_workflow("multistep", rounds=2, step_tokens=short, **common),
        "irg": get_workflow("irg", rounds=2, **common),
        "recomp": get_workflow("recomp", summary_tokens=short, **common),
    }


def handler(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    out = sys.stdout
    from ragserve.cli.launch_config import from_args
    from ragserve.retrieval.builtin import build_dtype

    bf16 = {"dtype": "bfloat16"} if build_dtype() == "bfloat16" else {}
    config = from_args(args, engine_defaults={**DEMO_ENGINE, **bf16})
    if not config.runtime.in_process and config.runtime.backend != "ray":
        from ragserve.runtime.worker_start import start_fork_server

        start_fork_server(config.runtime.worker_start_method)  # its imports overlap the rest
    _prepare(out, config.model, config.index)
    _step(out, "starting the LLM and index workers")
    with build_server(config) as server:
        _done(out, start, "ready")
        questions = QUESTIONS[: max(1, args.questions)]
        workflows = demo_workflows(args.max_tokens, args.topk)
        jobs = [(q, name) for q in questions for name in workflows]
        _step(out, f"answering {len(jobs)} requests concurrently")
        t0 = time.perf_counter()
        responses = asyncio.run(_run_all(server, jobs, workflows))
        wall = time.perf_counter() - t0
    out.write("\n")
    failed = _print_answers(out, jobs, responses)
    _print_timings(out, list(workflows), jobs, responses)
    out.write(
        f"\n{len(jobs)} requests ({len(questions)} questions x {len(workflows)} workflows) "
        f"concurrently in {wall:.1f} s; total {time.perf_counter() - start:.1f} s\n"
    )
    return 1 if failed else 0


def _prepare(out: Any, model: str, index: str) -> None:
    """First run only: the built-in model's conversion (mostly one core) overlaps the factbook
    index build (the embedder's threads). NOTE: in a spawned process, not a thread: two
    threads importing transformers' lazy modules at once can see a half-initialised module."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ragserve.cli.options import DEFAULT_INDEX, resolve_index
    from ragserve.generation.builtin import BUILTIN_MODELS, ensure_builtin, is_converted
    from ragserve.retrieval.builtin import builtin_index_dir, is_built

    convert = model in BUILTIN_MODELS and not is_converted(model)
    build = index == DEFAULT_INDEX and not is_built(builtin_index_dir(index))
    if not (convert or build):
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        t0 = time.perf_counter()
        if convert:
            _step(out, f"converting the built-in model {model} (first run only)")
            converted = pool.submit(ensure_builtin, model)
        if build:
            _step(out, "building the factbook index (first run only)")
            resolve_index(index)
            _done(out, t0, "index built")
        if convert:
            converted.result()
            _done(out, t0, "model converted")


def _step(out: Any, what: str) -> None:
    print(f"ragserve demo: {what} ...", file=out, flush=True)


def _done(out: Any, since: float, what: str = "done") -> None:
    print(f"  {what} in {time.perf_counter() - since:.1f} s", file=out, flush=True)


async def _run_all(server: Any, jobs: list, workflows: dict) -> list:
    return await asyncio.gather(*(server.submit(q, workflows[name]) for q, name in jobs))


def _print_answers(out: Any, jobs: list, responses: list) -> int:
    failed = 0
    for (question, name), r in zip(jobs, responses, strict=True):
        if name == jobs[0][1]:
            out.write(f"Q: {question}\n")
        answer = " ".join(r.output.split()) or "(empty)"
        if r.error is not None:
            failed += 1
            answer = f"ERROR {r.error}"
        titles = ", ".join(dict.fromkeys(t or d for d, t in zip(r.doc_ids, r.titles, strict=True)))
        out.write(f"  {name:<10} {answer[:160]}\n  {'':<10} sources: {titles[:160]}\n")
    return failed


def _print_timings(out: Any, names: list[str], jobs: list, responses: list) -> None:
    out.write("\nworkflow    requests  mean s   max s  retrieval s  generation s  nodes\n")
    for name in names:
        rs = [r for (_, n), r in zip(jobs, responses, strict=True) if n == name]
        lat = [r.latency for r in rs]
        ret = [_kind_seconds(r, "retrieval") for r in rs]
        gen = [_kind_seconds(r, "generation") for r in rs]
        nodes = statistics.mean(len(r.node_timings) for r in rs)
        out.write(
            f"{name:<10} {len(rs):>9} {statistics.mean(lat):>7.2f} {max(lat):>7.2f} "
            f"{statistics.mean(ret):>12.2f} {statistics.mean(gen):>13.2f} {nodes:>6.1f}\n"
        )


def _kind_seconds(r: Any, kind: str) -> float:
    return sum(t.duration or 0.0 for t in r.node_timings if t.kind == kind)
