"""Cache fusion TTFT and throughput vs full prefill and exact prefix reuse (H200 preset).

Workload: a pool of ``docs`` passages of ``passage_tokens`` tokens; each request holds a fixed
``prefix_tokens`` instruction prefix, ``topk`` distinct passages in a random order and a
fresh ``question_tokens`` question (greedy, random weights). Configurations, in this order:

- ``full``: no reuse (prefix caching off);
- ``prefix``: the knowledge tree's exact reuse (orders are shuffled, so it mostly reuses the
  instructions and, now and then, a first passage);
- ``fuse-<selector>-<r>``: cache fusion, the passages' KV stored in the same KV tiers (the
  offline step, every passage computed once and the selector's one-off work done, runs first
  and is not timed), ``r`` of each passage's tokens recomputed; the rows run in the batched
  forward through the paged attention kernel with per-query positions (the default);
- ``fuse-qcfuse-dense-<r>``: the same with ``fusion_paged_prefill=False`` (the dense
  per-request forward of sessions 1-2), side by side, for ``--dense-ratios``.

Per configuration: TTFT (``num_ttft`` requests one at a time: mean, p90) and throughput
(``num_requests`` submitted at once: requests/s, prompt tokens/s, output tokens/s), plus the
engine counters it moved. Engines are built one at a time: full, then tree + each selector
(the dense baseline's after the first). A configuration that raises is recorded with its
error and skipped; past ``--time-budget-s`` the rest are recorded as skipped. The JSON
(``--out``) is rewritten after every configuration; progress goes to stderr, one flushed
line per event.

    # H200 (one command, <= 8.5 min; past 400 s the rest is skipped): Llama-3.1-8B shape
    PYTHONUNBUFFERED=1 PYTHONPATH=src timeout 500 python3 bench/bench_fusion.py \\
        --preset h200-llama8b --out $OUT/fusion_h200.json 2>&1 | tee $OUT/fusion_h200.log
    # its CPU twin (tests/test_bench_fusion.py runs it): the same code on a tiny shape
    PYTHONPATH=src python bench/bench_fusion.py --preset cpu-tiny --out /tmp/fusion.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dummy_engine import LLAMA_31_8B, dummy_folder, free_device_memory  # noqa: E402
from ragserve.generation import LLMEngine, SamplingParams, Segment  # noqa: E402

log = logging.getLogger("bench_fusion")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024)  # fmt: skip
PRESETS = {
    "h200-llama8b": dict(config=LLAMA_31_8B, device="cuda", dtype="bfloat16", docs=20,
                         passage_tokens=1024, topk=5, question_tokens=32, prefix_tokens=32,
                         num_ttft=8, num_requests=32, max_tokens=16, kv_gb=40.0,
                         ratios=(0.15, 0.05, 0.30, 0.0, 1.0, 0.10), dense_ratios=(0.15, 1.0),
                         time_budget_s=400.0),
    "cpu-tiny": dict(config={**LLAMA_31_8B, **TINY}, device="cpu", dtype="float32", docs=6,
                     passage_tokens=40, topk=3, question_tokens=8, prefix_tokens=8,
                     num_ttft=2, num_requests=3, max_tokens=2, kv_gb=0.01,
                     ratios=(0.15, 1.0), dense_ratios=(1.0,), time_budget_s=120.0,
                     cpu_threads=1),
}  # fmt: skip
SELECTORS = ("qcfuse", "cacheblend", "sift")
COUNTERS = ("num_fused_tokens", "num_recomputed_tokens", "num_fusion_store_hits",
            "num_fusion_store_misses", "num_swapped_in_blocks", "num_evicted_gpu_blocks",
            "prefix_cache_hit_tokens", "preemptions")  # fmt: skip


def workload(p: dict, n: int, seed: int) -> list[list[Segment]]:
    """``n`` requests: the shared prefix, ``topk`` keyed passages shuffled, a fresh question."""
    rng = random.Random(seed)
    vocab = p["config"]["vocab_size"]
    docs = [[rng.randrange(3, vocab) for _ in range(p["passage_tokens"])] for _ in range(p["docs"])]
    prefix = [rng.randrange(3, vocab) for _ in range(p["prefix_tokens"])]
    out = []
    for _ in range(n):
        picked = rng.sample(range(len(docs)), p["topk"])
        question = [rng.randrange(3, vocab) for _ in range(p["question_tokens"])]
        segs = [Segment(docs[d], key=f"doc-{d}") for d in picked]
        out.append([Segment(prefix), *segs, Segment(question)])
    return out


def run(engine: LLMEngine, requests, ratio, max_tokens: int, together: bool) -> list:
    """The finished outputs, requests run one at a time or all at once; on an error every
    request still in the engine is aborted before it propagates."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    batches = [requests] if together else [[r] for r in requests]
    done = []
    for batch in batches:
        ids = [f"r{len(done) + i}" for i in range(len(batch))]
        try:
            for rid, segs in zip(ids, batch, strict=True):
                engine.add_request(rid, segs, params, fusion_ratio=ratio)
            while engine.has_unfinished():
                done += [out for out in engine.step() if out.finished]
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
    return done


def measure(engine: LLMEngine, p: dict, ttft_reqs, batch_reqs, ratio) -> dict:
    """TTFT one at a time, then throughput all at once; counters moved by both."""
    before = engine.stats()
    ttft = [o.metrics.ttft for o in run(engine, ttft_reqs, ratio, 1, together=False)]
    start = time.perf_counter()
    outs = run(engine, batch_reqs, ratio, p["max_tokens"], together=True)
    wall = time.perf_counter() - start
    after = engine.stats()
    prompt_tokens = sum(len(s.content) for segs in batch_reqs for s in segs)
    return {
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "throughput_req_s": len(outs) / wall,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "counters": {k: after[k] - before[k] for k in COUNTERS},
    }


def engine_plans(
    p: dict, selectors: list[str], ratios: list[float], dense_ratios: list[float] = ()
) -> list[tuple[str, list]]:
    """(engine kind, [(config name, fusion ratio)]) in run order: full, then per selector
    (the first with ``prefix``), the dense baseline after the first selector."""
    plans = [("full", [("full", None)])]
    for i, sel in enumerate(selectors):
        configs = [("prefix", None)] if i == 0 else []
        configs += [(f"fuse-{sel}-{r:g}", r) for r in ratios]
        plans.append((sel, configs))
        if i == 0 and dense_ratios:
            plans.append((f"{sel}-dense", [(f"fuse-{sel}-dense-{r:g}", r) for r in dense_ratios]))
    return plans


def make_engine(folder: Path, p: dict, kind: str) -> LLMEngine:
    """``kind``: ``"full"``, a selector, or ``"<selector>-dense"`` (the dense fused path)."""
    return LLMEngine(
        folder, device=p["device"], dtype=p["dtype"], load_format="dummy",
        max_model_len=8192, kv_cache_bytes=int(p["kv_gb"] * 2**30),
        max_num_seqs=max(p["num_requests"], 8), enable_prefix_caching=kind != "full",
        fusion_selector="qcfuse" if kind == "full" else kind.removesuffix("-dense"),
        fusion_paged_prefill=not kind.endswith("-dense"), cpu_threads=p.get("cpu_threads"),
    )  # fmt: skip


def run_all(p: dict, args: argparse.Namespace, folder: Path) -> dict:
    """Every configuration; errors and the time budget recorded per configuration."""
    ttft_reqs = workload(p, p["num_ttft"], args.seed)
    batch_reqs = workload(p, p["num_requests"], args.seed + 1)
    result: dict = {"preset": args.preset, "shape": {k: v for k, v in p.items() if k != "config"}}
    result["configs"] = {}
    start = time.perf_counter()
    for kind, configs in engine_plans(p, args.selectors, args.ratios, args.dense_ratios):
        engine, warmed = None, False
        for name, ratio in configs:
            if time.perf_counter() - start > args.time_budget_s:
                result["configs"][name] = {"skipped": f"time budget {args.time_budget_s}s"}
                log.info("%s: skipped (time budget)", name)
                continue
            try:
                if engine is None:
                    engine = make_engine(folder, p, kind)
                    run(engine, workload(p, 2, args.seed + 2), None, 1, together=False)
                if ratio is not None and not warmed:  # the offline step: store every passage
                    # NOTE: at the smallest r > 0 so the selector's one-off work (SIFT's index,
                    # kernel compiles of the probe) is done here, untimed, too.
                    offline = min((r for r in args.ratios if r > 0), default=0.0)
                    run(engine, ttft_reqs + batch_reqs, offline, 1, together=True)
                    warmed = True
                row = measure(engine, p, ttft_reqs, batch_reqs, ratio)
            except Exception as e:  # NOTE: one failing configuration must not end the run
                log.exception("%s failed", name)
                result["configs"][name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            result["configs"][name] = row
            log.info("%s: %s", name, {k: v for k, v in row.items() if k != "counters"})
            write(result, args.out)
        if engine is not None:
            del engine
            free_device_memory()
    return result


def summarize(result: dict) -> None:
    """TTFT speed-up of every measured configuration over full prefill and prefix reuse."""
    rows = {k: v for k, v in result["configs"].items() if "ttft_mean_s" in v}
    for base in ("full", "prefix"):
        if base in rows:
            for row in rows.values():
                row[f"ttft_speedup_vs_{base}"] = rows[base]["ttft_mean_s"] / row["ttft_mean_s"]
                row[f"throughput_vs_{base}"] = (
                    row["throughput_req_s"] / rows[base]["throughput_req_s"]
                )


def write(result: dict, out: Path | None) -> None:
    if out is not None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--ratios", default=None, help="comma list; default: the preset's")
    ap.add_argument(
        "--dense-ratios",
        default=None,
        help="comma list for the dense fused path ('none': skip); default: preset's",
    )
    ap.add_argument("--selectors", default=",".join(SELECTORS))
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    args.ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else p["ratios"]
    if args.dense_ratios is None:
        args.dense_ratios = list(p["dense_ratios"])
    elif args.dense_ratios == "none":
        args.dense_ratios = []
    else:
        args.dense_ratios = [float(r) for r in args.dense_ratios.split(",")]
    args.selectors = args.selectors.split(",")
    if bad := [s for s in args.selectors if s not in SELECTORS]:
        raise ValueError(f"--selectors: unknown {bad}; use {SELECTORS}")
    args.time_budget_s = args.time_budget_s or p["time_budget_s"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    folder = dummy_folder(Path(tempfile.mkdtemp()) / "llama-3.1-8b-random", p["config"])
    log.info("preset %s: %s", args.preset, {k: v for k, v in p.items() if k != "config"})
    result = run_all(p, args, folder)
    summarize(result)
    write(result, args.out)
    log.info("done: %d configurations, %d failed or skipped", len(result["configs"]),
             sum("ttft_mean_s" not in r for r in result["configs"].values()))  # fmt: skip
    return result


if __name__ == "__main__":
    main()
