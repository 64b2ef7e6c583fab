"""Document-KV reuse (RAGCache) in the LLM engine: TTFT and throughput per reuse configuration.

Workload (as RAGCache): a corpus of ``--docs`` passages of ``--passage-tokens`` tokens; each
request retrieves ``--topk`` distinct passages drawn by Zipf popularity (``--zipf``), in
relevance order, under a fixed instruction prefix, then a question of ``--question-tokens``
new tokens; greedy, ``--max-tokens`` out. The GPU KV budget (``--gpu-kv-tokens``) is small
so the host tier (``--host-kv-tokens``) matters. Two passes per configuration, side by side
in one process on the same engine weights:

- TTFT: Poisson arrivals at ``--rate`` req/s, mean / p90 time to first token;
- throughput: all requests at once, completed requests per second (sustained capacity).

``--rate 0`` (the CPU preset: the shared 2-core machine is too slow for two passes) runs only
the all-at-once pass and reports its TTFT (queueing included) and throughput.

Configurations: no reuse, block prefix cache (the engine before the knowledge tree), the
tree on the GPU only and GPU + host with LRU and PGDSF, and cache-aware admission on/off.
Outputs are compared token by token with the no-reuse run (``identical`` in the JSON).

    # CPU, SmolLM2 (ratios only)
    PYTHONPATH=src python bench/bench_kv_reuse.py --preset cpu-smollm2 --out kv_cpu.json
    # H200, Llama-3.1-8B shape with random weights (a few minutes per configuration: run
    # subsets with --configs to stay within a 10-minute command limit)
    PYTHONPATH=src python bench/bench_kv_reuse.py --preset h200-llama8b --out kv_h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import LLAMA_31_8B  # noqa: E402
from ragserve.generation import LLMEngine, SamplingParams  # noqa: E402
from ragserve.generation.model_runner import kv_cache_bytes_per_block  # noqa: E402

log = logging.getLogger("bench_kv_reuse")

PRESETS = {
    "cpu-smollm2": dict(
        model="smollm2-135m-instruct", device="cpu", dtype="float32", docs=16,
        passage_tokens=32, topk=4, question_tokens=8, num_requests=16, rate=0.0,
        max_tokens=2, gpu_kv_tokens=640, host_kv_tokens=4000, zipf=1.1, cpu_threads=1,
        max_num_batched_tokens=1024,
    ),
    "h200-llama8b": dict(
        model="llama-3.1-8b-dummy", device="cuda", dtype="bfloat16", docs=2000,
        passage_tokens=1024, topk=5, question_tokens=64, num_requests=200, rate=2.0,
        max_tokens=32, gpu_kv_tokens=60000, host_kv_tokens=200000, zipf=1.1, cpu_threads=None,
        max_num_batched_tokens=8192,
    ),
}  # fmt: skip

CONFIGS = {
    "no_reuse": dict(enable_prefix_caching=False, enable_cache_aware_scheduling=False),
    "block_cache": dict(enable_knowledge_tree=False, enable_cache_aware_scheduling=False),
    "tree_gpu_lru": dict(kv_eviction_policy="lru", enable_cache_aware_scheduling=False),
    "tree_gpu_pgdsf": dict(kv_eviction_policy="pgdsf", enable_cache_aware_scheduling=False),
    "tree_host_lru": dict(
        host=True, kv_eviction_policy="lru", enable_cache_aware_scheduling=False
    ),
    "tree_host_pgdsf": dict(
        host=True, kv_eviction_policy="pgdsf", enable_cache_aware_scheduling=False
    ),
    "tree_host_pgdsf_aware": dict(host=True, kv_eviction_policy="pgdsf"),
}  # fmt: skip


def make_workload(a: argparse.Namespace) -> list[tuple[list[int], tuple[int, ...], float]]:
    """(prompt ids, segment ends, arrival offset in s) per request; seeded."""
    rng = np.random.default_rng(a.seed)
    vocab_hi = 30000  # ordinary tokens of both tokenizers' ranges
    docs = [rng.integers(1000, vocab_hi, a.passage_tokens).tolist() for _ in range(a.docs)]
    instr = rng.integers(1000, vocab_hi, 48).tolist()
    popularity = 1.0 / np.arange(1, a.docs + 1) ** a.zipf
    popularity /= popularity.sum()
    gaps = rng.exponential(1.0 / a.rate, a.num_requests) if a.rate > 0 else np.zeros(a.num_requests)
    arrivals = np.cumsum(gaps)
    out = []
    for t in arrivals:
        chosen = rng.choice(a.docs, size=a.topk, replace=False, p=popularity)
        ids, ends = list(instr), [len(instr)]
        for d in chosen:
            ids += docs[int(d)]
            ends.append(len(ids))
        ids += rng.integers(1000, vocab_hi, a.question_tokens).tolist()
        ends.append(len(ids))
        out.append((ids, tuple(ends), float(t - arrivals[0])))
    return out


def run_pass(engine: LLMEngine, workload, params: SamplingParams, paced: bool) -> dict:
    """Drive the engine; ``paced`` adds requests at their arrival times, else all at t=0."""
    start = time.monotonic()
    pending = list(enumerate(workload))
    ttfts, outputs, first = {}, {}, {}
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and (not paced or pending[0][1][2] <= now):
            i, (ids, ends, _) = pending.pop(0)
            engine.add_request(str(i), ids, params, segment_ends=ends)
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(pending[0][1][2] - now, 0.0)))
            continue
        for out in engine.step():
            i = int(out.request_id)
            if i not in first:
                first[i] = True
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


def build_engine(model: str, a: argparse.Namespace, config: dict) -> LLMEngine:
    kw = dict(config)
    host = kw.pop("host", False)
    probe_bytes = _kv_bytes_per_token(model, a)
    engine = LLMEngine(
        model,
        device=a.device,
        dtype=a.dtype,
        load_format="dummy" if a.dummy else "auto",
        kv_cache_bytes=a.gpu_kv_tokens * probe_bytes,
        host_kv_cache_bytes=a.host_kv_tokens * probe_bytes if host else 0,
        max_model_len=a.topk * a.passage_tokens + a.question_tokens + 48 + a.max_tokens + 16,
        max_num_batched_tokens=a.max_num_batched_tokens,
        cpu_threads=a.cpu_threads,
        **kw,
    )
    if kw.get("kv_eviction_policy") == "pgdsf":
        lengths = (a.passage_tokens // 2, a.passage_tokens)
        log.info("profiled prefill cost: %s", engine.profile_prefill_cost(lengths))
    return engine


def _kv_bytes_per_token(model: str, a: argparse.Namespace) -> int:
    import torch

    from ragserve.generation import ModelConfig
    from ragserve.generation.builtin import resolve_model

    folder = Path(model) if a.dummy else resolve_model(model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    return kv_cache_bytes_per_block(ModelConfig.from_folder(folder), 16, dtype) // 16


def dummy_folder(root: Path) -> Path:
    """A Llama-3.1-8B-shaped config (weights random at load: ``load_format="dummy"``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smollm2")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    for key, value in PRESETS["cpu-smollm2"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value))
    a = p.parse_args()
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a.dummy = a.model.endswith("-dummy")
    tmp = tempfile.TemporaryDirectory()
    model = str(dummy_folder(Path(tmp.name) / "llama8b")) if a.dummy else a.model
    workload = make_workload(a)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    results = {"preset": a.preset, "args": {k: v for k, v in vars(a).items() if k != "out"}}
    baseline = None
    for name in a.configs.split(","):
        engine = build_engine(model, a, CONFIGS[name])
        thr = run_pass(engine, workload, params, paced=False)
        ttft = thr
        if a.rate > 0:
            engine.block_manager.reset_prefix_cache()
            ttft = run_pass(engine, workload, params, paced=True)
        stats = engine.stats()
        baseline = baseline or ttft["outputs"]
        row = {
            "mean_ttft_s": ttft["mean_ttft_s"],
            "p90_ttft_s": ttft["p90_ttft_s"],
            "throughput_rps": thr["requests_per_s"],
            "identical": ttft["outputs"] == baseline and thr["outputs"] == baseline,
            "stats": stats,
        }
        results[name] = row
        log.info("%s: %s", name, {k: v for k, v in row.items() if k != "stats"})
        del engine
    ref = results.get("no_reuse")
    if ref:
        for name in a.configs.split(","):
            r = results[name]
            r["ttft_speedup"] = ref["mean_ttft_s"] / r["mean_ttft_s"]
            r["throughput_ratio"] = r["throughput_rps"] / ref["throughput_rps"]
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=1, default=str))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
