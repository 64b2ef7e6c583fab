"""Document-KV reuse (RAGCache) in the LLM engine: TTFT and throughput per reuse configuration.

Workload (as RAGCache): a corpus of ``--docs`` passages of ``--passage-tokens`` tokens with
Zipf popularity (``--zipf``); each request retrieves ``--topk`` distinct passages in relevance
order under a fixed instruction prefix, then a question of ``--question-tokens`` new tokens;
greedy, ``--max-tokens`` out. With ``--topics N`` requests ask about N topics (Zipf over
topics), each topic a fixed relevance list drawn as above, as repeated popular questions do
(high reuse); with 0 every request draws its own list. The GPU KV budget
(``--gpu-kv-tokens``) is small so the host tier (``--host-kv-tokens``) matters. Two passes per
configuration, one engine each, one after the other in one process:

- throughput: all requests at once, completed requests per second (sustained capacity);
- TTFT: Poisson arrivals at ``--rate`` req/s (or, with ``--load``, that share of the first
  configuration's measured throughput), mean / p90 time to first token.

``--rate 0 --load 0`` (the CPU presets) runs only the all-at-once pass and reports its TTFT
(queueing included) and throughput.

Configurations (``CONFIGS``): no reuse, block prefix cache (the engine before the knowledge
tree), the tree on the GPU only and GPU + host with LRU and PGDSF, cache-aware admission on
(window 8) in the last one only. Outputs are compared token by token with the first
configuration's (``identical``). A configuration that fails is recorded (``error``) and the
run goes on; with ``--time-budget`` a configuration that would start after the budget is
spent is skipped, and a pass still running at the budget is stopped (``error``: timeout).
The JSON (``--out``) is rewritten after every configuration; progress goes to stdout.

    # CPU, SmolLM2 (ratios only)
    PYTHONPATH=src python bench/bench_kv_reuse.py --preset cpu-smollm2 --out kv_cpu.json
    # H200, Llama-3.1-8B shape with random bf16 weights; one command, <= 5 minutes
    PYTHONPATH=src python -u bench/bench_kv_reuse.py --preset h200-llama8b --out kv_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import LLAMA_31_8B, SMOKE  # noqa: E402
from ragserve.generation import LLMEngine, SamplingParams  # noqa: E402
from ragserve.generation.model_runner import kv_cache_bytes_per_block  # noqa: E402

log = logging.getLogger("bench_kv_reuse")

DUMMY_MODELS = {"llama-3.1-8b-dummy": LLAMA_31_8B, "tiny-llama-dummy": {**LLAMA_31_8B, **SMOKE}}

PRESETS = {
    "cpu-smollm2": dict(
        model="smollm2-135m-instruct", device="cpu", dtype="float32", docs=16,
        passage_tokens=32, topk=4, question_tokens=8, num_requests=16, rate=0.0, load=0.0,
        topics=0, max_tokens=2, gpu_kv_tokens=640, host_kv_tokens=4000, zipf=1.1,
        cpu_threads=1, max_num_seqs=256, max_num_batched_tokens=1024, time_budget=0.0,
    ),
    # the CPU twin of h200-llama8b (same code path, same shape of workload, tiny sizes): the
    # default test suite runs it so that a typo cannot reach the device
    "cpu-tiny": dict(
        model="tiny-llama-dummy", device="cpu", dtype="float32", docs=40, passage_tokens=32,
        topk=5, question_tokens=8, num_requests=12, rate=0.0, load=0.8, topics=6,
        max_tokens=4, gpu_kv_tokens=640, host_kv_tokens=1280, zipf=1.1, cpu_threads=1,
        max_num_seqs=16, max_num_batched_tokens=512, time_budget=120.0,
    ),
    # one H200: 48 requests of ~5.2k tokens; the paced pass offers 80 % of no reuse's capacity;
    # GPU pool ~9 prompts (6 GB), host tier ~18 prompts (12 GB pinned); <= 240 s of passes
    "h200-llama8b": dict(
        model="llama-3.1-8b-dummy", device="cuda", dtype="bfloat16", docs=2000,
        passage_tokens=1024, topk=5, question_tokens=64, num_requests=48, rate=0.0, load=0.8,
        topics=100, max_tokens=32, gpu_kv_tokens=48000, host_kv_tokens=96000, zipf=1.1,
        cpu_threads=0, max_num_seqs=64, max_num_batched_tokens=8192, time_budget=240.0,
    ),
}  # fmt: skip

# most telling first: a run cut short by its time budget still compares the main ones
CONFIGS = {
    "no_reuse": dict(enable_prefix_caching=False, enable_cache_aware_scheduling=False),
    "block_cache": dict(enable_knowledge_tree=False, enable_cache_aware_scheduling=False),
    "tree_host_pgdsf_aware": dict(host=True, kv_eviction_policy="pgdsf"),
    "tree_host_pgdsf": dict(
        host=True, kv_eviction_policy="pgdsf", enable_cache_aware_scheduling=False
    ),
    "tree_gpu_pgdsf": dict(kv_eviction_policy="pgdsf", enable_cache_aware_scheduling=False),
    "tree_host_lru": dict(
        host=True, kv_eviction_policy="lru", enable_cache_aware_scheduling=False
    ),
    "tree_gpu_lru": dict(kv_eviction_policy="lru", enable_cache_aware_scheduling=False),
    # tree_host_pgdsf with the host tier's swap-outs as before the H200 run's fixes (blocking,
    # every evicted block copied): the side-by-side check of async_swap_out + swap_out_filter
    "tree_host_pgdsf_sync_out": dict(
        host=True, kv_eviction_policy="pgdsf", enable_cache_aware_scheduling=False,
        async_swap_out=False, swap_out_filter=False,
    ),
}  # fmt: skip


class PassTimeout(Exception):
    """A pass ran past the run's time budget."""


def make_workload(a: argparse.Namespace) -> list[tuple[list[int], tuple[int, ...], float]]:
    """(prompt ids, segment ends, arrival offset at rate 1 req/s) per request; seeded."""
    rng = np.random.default_rng(a.seed)
    vocab_hi = 30000  # ordinary tokens of both tokenizers' ranges
    docs = [rng.integers(1000, vocab_hi, a.passage_tokens).tolist() for _ in range(a.docs)]
    instr = rng.integers(1000, vocab_hi, 48).tolist()
    popularity = _zipf(a.docs, a.zipf)

    def draw() -> list[int]:
        return [int(d) for d in rng.choice(a.docs, size=a.topk, replace=False, p=popularity)]

    topics = [draw() for _ in range(a.topics)]
    topic_popularity = _zipf(a.topics, a.zipf) if a.topics else None
    arrivals = np.cumsum(rng.exponential(1.0, a.num_requests))
    out = []
    for t in arrivals:
        chosen = topics[rng.choice(a.topics, p=topic_popularity)] if a.topics else draw()
        ids, ends = list(instr), [len(instr)]
        for d in chosen:
            ids += docs[d]
            ends.append(len(ids))
        ids += rng.integers(1000, vocab_hi, a.question_tokens).tolist()
        ends.append(len(ids))
        out.append((ids, tuple(ends), float(t - arrivals[0])))
    return out


def _zipf(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return p / p.sum()


def run_pass(engine: LLMEngine, workload, params, rate: float, deadline: float | None) -> dict:
    """Drive the engine; requests arrive at ``rate`` req/s (0: all at t=0)."""
    start = time.monotonic()
    pending = [(i, ids, ends, t / rate if rate > 0 else 0.0)
               for i, (ids, ends, t) in enumerate(workload)]  # fmt: skip
    pending.reverse()
    ttfts, outputs = {}, {}
    last_log = start
    while pending or engine.has_unfinished():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise PassTimeout(f"stopped at the time budget after {len(outputs)} requests")
        if now - last_log > 10.0:
            log.info("  ... %d/%d done, %d running", len(outputs), len(workload), len(ttfts))
            last_log = now
        while pending and pending[-1][3] <= now - start:
            i, ids, ends, _ = pending.pop()
            engine.add_request(str(i), ids, params, segment_ends=ends)
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(pending[-1][3] - (now - start), 0.0)))
            continue
        for out in engine.step():
            i = int(out.request_id)
            if i not in ttfts:
                ttfts[i] = out.metrics.first_token_time - out.metrics.arrival_time
            if out.finished:
                outputs[i] = out.token_ids
    seconds = time.monotonic() - start
    t = np.asarray([ttfts[i] for i in sorted(ttfts)])
    return {
        "mean_ttft_s": float(t.mean()),
        "p90_ttft_s": float(np.percentile(t, 90)),
        "seconds": seconds,
        "requests_per_s": len(workload) / seconds,
        "outputs": [outputs[i] for i in range(len(workload))],
    }


def engine_kwargs(a: argparse.Namespace, config: dict, per_token: int) -> dict:
    """``LLMEngine`` keyword arguments of one configuration (``CONFIGS[name]``)."""
    kw = dict(config)
    host = kw.pop("host", False)
    return dict(
        device=a.device,
        dtype=a.dtype,
        load_format="dummy" if a.dummy else "auto",
        kv_cache_bytes=a.gpu_kv_tokens * per_token,
        host_kv_cache_bytes=a.host_kv_tokens * per_token if host else 0,
        max_model_len=max_model_len(a),
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        cpu_threads=a.cpu_threads or None,
        **kw,
    )


def build_engine(model: str, a: argparse.Namespace, config: dict) -> LLMEngine:
    kw = engine_kwargs(a, config, kv_bytes_per_token(model, a))
    engine = LLMEngine(model, **kw)
    if kw.get("kv_eviction_policy") == "pgdsf":
        # several lengths up to two passages: a GPU prefill of a few hundred tokens is mostly
        # per-call overhead (the profile rejects a fit dominated by it)
        lengths = (a.passage_tokens // 2, a.passage_tokens, 2 * a.passage_tokens)
        log.info("  profiled prefill cost: %s", engine.profile_prefill_cost(lengths))
    return engine


def max_model_len(a: argparse.Namespace) -> int:
    return a.topk * a.passage_tokens + a.question_tokens + 48 + a.max_tokens + 16


def kv_bytes_per_token(model: str, a: argparse.Namespace) -> int:
    import torch

    from ragserve.generation import ModelConfig
    from ragserve.generation.builtin import resolve_model

    folder = Path(model) if a.dummy else resolve_model(model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    return kv_cache_bytes_per_block(ModelConfig.from_folder(folder), 16, dtype) // 16


def dummy_folder(root: Path, name: str) -> Path:
    """A config-only model folder of ``DUMMY_MODELS[name]`` (random weights at load)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(DUMMY_MODELS[name]))
    return root


def warm_up(engine: LLMEngine, workload, params: SamplingParams) -> None:
    """One request through every kernel shape (compiles, graph captures) before timing; the
    cache it leaves is dropped."""
    engine.generate([workload[0][0]], params)
    engine.block_manager.reset_prefix_cache()


def run_config(name: str, model: str, a, workload, params, deadline, state: dict) -> dict:
    engine = build_engine(model, a, CONFIGS[name])
    try:
        warm_up(engine, workload, params)
        thr = run_pass(engine, workload, params, 0.0, deadline)
        log.info("  throughput pass: %.3f req/s", thr["requests_per_s"])
        if state.get("rate") is None:
            state["rate"] = a.rate or a.load * thr["requests_per_s"]
        ttft = thr
        if state["rate"] > 0:
            engine.block_manager.reset_prefix_cache()
            ttft = run_pass(engine, workload, params, state["rate"], deadline)
        state.setdefault("baseline", (name, ttft["outputs"]))
        base_name, base = state["baseline"]
        return {
            "mean_ttft_s": ttft["mean_ttft_s"],
            "p90_ttft_s": ttft["p90_ttft_s"],
            "throughput_rps": thr["requests_per_s"],
            "rate_rps": state["rate"],
            "identical": ttft["outputs"] == base and thr["outputs"] == base,
            "identical_to": base_name,
            "stats": engine.stats(),
        }
    finally:
        del engine
        _free_device_memory()


def _free_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_ratios(results: dict, names: list[str]) -> None:
    for ref_name, tag in (("no_reuse", "vs_no_reuse"), ("block_cache", "vs_block_cache")):
        ref = results["configs"].get(ref_name, {})
        if "mean_ttft_s" not in ref:
            continue
        for name in names:
            r = results["configs"].get(name, {})
            if "mean_ttft_s" in r:
                r[f"ttft_speedup_{tag}"] = ref["mean_ttft_s"] / r["mean_ttft_s"]
                r[f"throughput_ratio_{tag}"] = r["throughput_rps"] / ref["throughput_rps"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smollm2")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    for key, value in PRESETS["cpu-smollm2"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value))
    a = p.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    unknown = [c for c in a.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if a.topics < 0 or a.topk > a.docs or a.num_requests < 1:
        p.error("need --topics >= 0, --topk <= --docs and --num-requests >= 1")
    a.dummy = a.model in DUMMY_MODELS
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout
    )
    started = time.monotonic()
    deadline = started + a.time_budget if a.time_budget else None
    tmp = tempfile.TemporaryDirectory()
    model = str(dummy_folder(Path(tmp.name) / "model", a.model)) if a.dummy else a.model
    workload = make_workload(a)
    mean_prompt = float(np.mean([len(ids) for ids, _, _ in workload]))
    log.info("%s: %d requests, mean prompt %.0f tokens", a.preset, len(workload), mean_prompt)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out"}
    results: dict = {"preset": a.preset, "args": args, "configs": {}}
    names = a.configs.split(",")
    state: dict = {}
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            results["configs"][name] = {"skipped": "time budget spent"}
            log.info("%s: skipped (time budget spent)", name)
            continue
        log.info("%s: starting (%.0f s elapsed)", name, time.monotonic() - started)
        try:
            row = run_config(name, model, a, workload, params, deadline, state)
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next one
            row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log.error("%s failed: %s", name, row["error"])
        _free_device_memory()  # after the except clause: its traceback held the engine
        results["configs"][name] = row
        log.info("%s: %s", name, {k: v for k, v in row.items() if k not in ("stats", "traceback")})
        add_ratios(results, names)
        results["seconds"] = time.monotonic() - started
        if a.out:
            a.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    log.info("done in %.0f s", time.monotonic() - started)
    tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
