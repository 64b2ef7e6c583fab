"""Document-KV reuse (RAGCache) in the LLM engine: TTFT, sustained throughput and prefill work
per reuse configuration.

Workload: ``kv_reuse_workload`` (RAGCache's: Zipf-popular passages under a fixed instruction,
``--topics`` repeated relevance lists); greedy, ``--max-tokens`` out. The **working set**
(logged and in the JSON) is what the tiers compete for: the ``*-tiers`` presets make it larger
than the GPU KV pool (``--gpu-kv-tokens``) and smaller than GPU + host (``--host-kv-tokens``),
so a GPU-only cache thrashes and the host tier can keep it all.

Per configuration (``CONFIGS``), a fresh engine, one after the other in one process
(``kv_reuse_passes`` has each pass's method):

1. **replay**: ``--num-requests`` requests of a fixed seeded sequence, all at once; it
   leaves the cache in the state of a server that has seen the workload. Then a **warm
   replay** (another draw of ``--num-requests`` from the same distribution, all at once)
   measures the steady state: its prompt tokens computed are ``prefill_tokens`` (the cold
   replay's: ``prefill_tokens_cold``). With sustained passes on, a configuration without a
   cache skips the warm replay (it would repeat the cold one). The replays' tokens are
   compared with the first configuration's (``agreement``: the share of requests whose
   tokens are equal; ``identical``: all are; the warm replay counts where both have one).
   With ``--control`` the first configuration replays its cold requests once more in a
   shuffled arrival order (``control.agreement``). The passes below start warm.
2. **sustained** (``--window-requests`` > 0): the TTFT probe at the common rate, then for
   ``--capacity-configs`` the capacity search.

Without ``--window-requests`` (the small CPU presets) only the replays run, and the cold
replay's TTFT (queueing included) and all-at-once throughput are reported.

Configurations: no reuse, block prefix cache (the engine before the knowledge tree), the tree
on the GPU only and GPU + host with LRU and PGDSF, cache-aware admission on (window 8) in
``tree_host_pgdsf_aware`` only (``tree_host_pgdsf_sync_out``, the swap-outs as before the
first H200 run's fixes, runs only when named in ``--configs``). A configuration that fails
is recorded (``error``) and the run goes on; with ``--time-budget`` a configuration that
would start after the budget is spent is skipped, and a pass still running at the budget is
stopped (``error``: timeout). The JSON (``--out``) is rewritten after every configuration;
progress goes to stdout.

    # CPU, SmolLM2 (ratios only)
    PYTHONPATH=src python bench/bench_kv_reuse.py --preset cpu-smollm2 --out kv_cpu.json
    # H200, Llama-3.1-8B shape with random bf16 weights, working set > GPU pool; <= 9 minutes
    PYTHONPATH=src python -u bench/bench_kv_reuse.py --preset h200-llama8b-tiers --out kv.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dummy_engine import LLAMA_31_8B, SMOKE, dummy_folder, free_device_memory  # noqa: E402
from kv_cost_profile import profile_kv_costs  # noqa: E402
from kv_reuse_passes import (  # noqa: E402
    PassTimeout,
    agreement,
    control_replay,
    logged_replay,
    replay,
    rounded,
    sustained_passes,
)
from kv_reuse_workload import (  # noqa: E402
    INSTRUCTION_TOKENS,
    make_corpus,
    make_workload,
    working_set_tokens,
)
from ragserve.generation import LLMEngine, SamplingParams  # noqa: E402
from ragserve.generation.model_runner import kv_cache_bytes_per_block  # noqa: E402

log = logging.getLogger("bench_kv_reuse")

DUMMY_MODELS = {"llama-3.1-8b-dummy": LLAMA_31_8B, "tiny-llama-dummy": {**LLAMA_31_8B, **SMOKE}}


# settings every preset has unless it says otherwise (no sustained passes)
DEFAULTS = dict(
    rate=0.0, load=0.0, slo=0.0, warmup_s=0.0, window_requests=0, ttft_requests=0,
    drain_s=0.0, max_probes=4, rel_tol=0.1, capacity_guess=0.9, reserve_s=0.0,
    max_latency_growth=0.05, time_budget=0.0,
)  # fmt: skip

PRESETS = {
    "cpu-smollm2": dict(
        model="smollm2-135m-instruct", device="cpu", dtype="float32", docs=16,
        passage_tokens=32, topk=4, question_tokens=8, num_requests=16, topics=0, max_tokens=2,
        gpu_kv_tokens=640, host_kv_tokens=4000, zipf=1.1, cpu_threads=1, max_num_seqs=256,
        max_num_batched_tokens=1024,
    ),
    # the CPU twin of h200-llama8b (same code path, same shape of workload, tiny sizes): the
    # default test suite runs it so that a typo cannot reach the device
    "cpu-tiny": dict(
        model="tiny-llama-dummy", device="cpu", dtype="float32", docs=40, passage_tokens=32,
        topk=5, question_tokens=8, num_requests=12, topics=6, max_tokens=4, gpu_kv_tokens=640,
        host_kv_tokens=1280, zipf=1.1, cpu_threads=1, max_num_seqs=16,
        max_num_batched_tokens=512, time_budget=120.0,
    ),
    # one H200, the first session's workload (100 topics, 48 requests, all of them fit
    # GPU + host only partly); kept for comparison with the table of 2026-12-01 00:02
    "h200-llama8b": dict(
        model="llama-3.1-8b-dummy", device="cuda", dtype="bfloat16", docs=2000,
        passage_tokens=1024, topk=5, question_tokens=64, num_requests=48, topics=100,
        max_tokens=32, gpu_kv_tokens=48000, host_kv_tokens=96000, zipf=1.1, cpu_threads=0,
        max_num_seqs=64, max_num_batched_tokens=8192, time_budget=240.0,
    ),
    # One H200, a workload where the tiers matter. Llama-3.1-8B keeps 2 (K, V) x 32 layers x
    # 8 KV heads x 128 dims x 2 bytes = 131,072 bytes (128 KiB) of KV per token, so a prompt
    # of 48 + 5 x 1,024 + 64 = 5,232 tokens holds 686 MB. 32 topics (fixed top-5 lists over
    # 400 passages drawn by Zipf s = 1.1; topics asked by Zipf s = 1.1) share only the
    # instruction and some first passages: working set 150,576 tokens (19.7 GB; logged).
    # GPU pool 48k tokens (6.3 GB, ~9 prompts, and the running requests' own blocks come out
    # of it): the working set is 3.1x the pool, so a GPU-only cache thrashes (LRU under Zipf
    # s = 1.1 over 32 lists keeps ~30-45 % of the prefixes at 3-5 cached prompts). Host tier
    # 176k tokens (23 GB pinned): it alone holds the working set. A host hit costs a 686 MB
    # host-to-device copy (~15-30 ms over PCIe 5) against a ~0.2 s prefill. Replays of 48
    # requests; capacity probes of 1 s of warm-up arrivals + 150 counted ones, TTFT probes
    # of 24 at 0.6 x no_reuse's replay rate; SLO 4 s (prefill, 32 decode steps, queueing),
    # drain 4 s; the capacity search starts at 0.95 x the warm replay's rate (the 04:49 run's
    # no_reuse saturated near 0.92 x; a 5 % overload passes). The time budget (480 s) keeps a
    # 7-configuration call under 9 minutes.
    "h200-llama8b-tiers": dict(
        model="llama-3.1-8b-dummy", device="cuda", dtype="bfloat16", docs=400,
        passage_tokens=1024, topk=5, question_tokens=64, num_requests=48, topics=32,
        max_tokens=32, gpu_kv_tokens=48000, host_kv_tokens=176000, zipf=1.1, cpu_threads=0,
        max_num_seqs=64, max_num_batched_tokens=8192, load=0.6, slo=4.0, warmup_s=1.0,
        window_requests=150, ttft_requests=24, drain_s=4.0, max_probes=4, capacity_guess=0.95,
        time_budget=480.0,
    ),
    # its CPU twin: the same shape scaled down (passages of 64 tokens, 32 topics, working set
    # 9,136 tokens, 3.0x the GPU pool, within the host tier), tiny random model; prefill
    # tokens computed are the ratio to read here, times on the shared machine are noise
    "cpu-tiny-tiers": dict(
        model="tiny-llama-dummy", device="cpu", dtype="float32", docs=400, passage_tokens=64,
        topk=5, question_tokens=16, num_requests=96, topics=32, max_tokens=4,
        gpu_kv_tokens=3072, host_kv_tokens=11264, zipf=1.1, cpu_threads=1, max_num_seqs=64,
        max_num_batched_tokens=1024, time_budget=600.0,
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
DEFAULT_CONFIGS = [name for name in CONFIGS if name != "tree_host_pgdsf_sync_out"]


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
        log.info("  profiled prefill cost: %s", profile_kv_costs(engine, lengths))
    return engine


def max_model_len(a: argparse.Namespace) -> int:
    return a.topk * a.passage_tokens + a.question_tokens + INSTRUCTION_TOKENS + a.max_tokens + 16


def kv_bytes_per_token(model: str, a: argparse.Namespace) -> int:
    import torch

    from ragserve.generation import ModelConfig
    from ragserve.generation.builtin import resolve_model

    folder = Path(model) if a.dummy else resolve_model(model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    return kv_cache_bytes_per_block(ModelConfig.from_folder(folder), 16, dtype) // 16


def warm_up(engine: LLMEngine, workload, params: SamplingParams) -> None:
    """One request through every kernel shape (compiles, graph captures) before timing; the
    cache it leaves is dropped."""
    engine.generate([workload[0][0]], params)
    engine.block_manager.reset_prefix_cache()


def run_config(name: str, model: str, a, workload, corpus, params, deadline, state) -> dict:
    engine = build_engine(model, a, CONFIGS[name])
    try:
        warm_up(engine, workload, params)
        rep = logged_replay("replay", replay(engine, workload, params, deadline))
        row: dict = {}
        if a.control and "baseline" not in state:
            row["control"] = control_replay(engine, workload, params, deadline, rep["outputs"])
        warm = None
        if CONFIGS[name].get("enable_prefix_caching", True) or not a.window_requests:
            warm = replay(engine, make_workload(a, second=True), params, deadline)
            logged_replay("warm replay", warm)
        outputs = (rep.pop("outputs"), warm.pop("outputs") if warm else None)
        state.setdefault("baseline", (name, outputs))
        base_name, base = state["baseline"]
        share = agreement(outputs[0] + (outputs[1] if base[1] and outputs[1] else []),
                          base[0] + (base[1] if base[1] and outputs[1] else []))  # fmt: skip
        steady = warm or rep  # NOTE: without a cache the cold replay is the steady state
        row |= {
            "mean_ttft_s": rep["mean_ttft_s"],
            "p90_ttft_s": rep["p90_ttft_s"],
            "throughput_rps": rep["requests_per_s"],
            "throughput_method": "all at once",
            "prefill_tokens": steady["prefill_tokens"],
            "prefill_tokens_cold": rep["prefill_tokens"],
            "replay": rep,
            "warm_replay": warm,
            "agreement": share,
            "identical": share == 1.0,
            "identical_to": base_name,
        }
        if a.window_requests > 0:
            try:
                row |= sustained_passes(
                    name, engine, corpus, a, params, steady["requests_per_s"], deadline, state
                )
            except PassTimeout as exc:  # NOTE: the replays' figures are kept
                row["error"] = f"PassTimeout: {exc}"
        row["stats"] = engine.stats()
        return row
    finally:
        del engine  # NOTE: freed by the caller's collect, after its except clause


def add_ratios(results: dict, names: list[str]) -> None:
    for ref_name, tag in (("no_reuse", "vs_no_reuse"), ("block_cache", "vs_block_cache")):
        ref = results["configs"].get(ref_name, {})
        for name in names:
            r = results["configs"].get(name, {})
            if ref.get("mean_ttft_s") and r.get("mean_ttft_s"):
                r[f"ttft_speedup_{tag}"] = ref["mean_ttft_s"] / r["mean_ttft_s"]
            if ref.get("throughput_rps") and r.get("throughput_rps"):
                r[f"throughput_ratio_{tag}"] = r["throughput_rps"] / ref["throughput_rps"]
            if ref.get("prefill_tokens") and r.get("prefill_tokens"):
                r[f"prefill_reduction_{tag}"] = ref["prefill_tokens"] / r["prefill_tokens"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smollm2")
    p.add_argument("--configs", default=None, help="comma-separated subset (default: all but "
                   "tree_host_pgdsf_sync_out)")  # fmt: skip
    p.add_argument("--capacity-configs", default=None, help="comma-separated: the configurations "
                   "whose sustained capacity is searched (default: all; the others get the "
                   "common-rate TTFT probe only)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control", action="store_true", help="the first configuration replays "
                   "its cold requests again in another order: agreement's noise floor")  # fmt: skip
    for key, value in {**PRESETS["cpu-smollm2"], **DEFAULTS}.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value))
    a = p.parse_args(argv)
    for key, value in {**DEFAULTS, **PRESETS[a.preset]}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.configs = a.configs or ",".join(DEFAULT_CONFIGS)
    unknown = [c for c in a.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    a.capacity_configs = (a.capacity_configs or a.configs).split(",")
    unknown = [c for c in a.capacity_configs if c not in CONFIGS]
    if unknown:
        p.error(f"--capacity-configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if a.topics < 0 or a.topk > a.docs or a.num_requests < 1:
        p.error("need --topics >= 0, --topk <= --docs and --num-requests >= 1")
    if a.window_requests > 0 and not (
        a.slo > 0 and (a.rate > 0 or a.load > 0) and a.window_requests >= 2
        and a.ttft_requests >= 2 and a.warmup_s >= 0 and a.drain_s >= 0
    ):  # fmt: skip
        p.error("--window-requests needs --slo and --rate or --load above 0, "
                "--window-requests and --ttft-requests >= 2")  # fmt: skip
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
    model = (
        str(dummy_folder(Path(tmp.name) / "model", DUMMY_MODELS[a.model])) if a.dummy else a.model
    )
    workload = make_workload(a)
    corpus = make_corpus(a)
    mean_prompt = float(np.mean([len(ids) for ids, _, _ in workload]))
    working_set = working_set_tokens(a, workload)
    log.info(
        "%s: %d requests, mean prompt %.0f tokens; working set %d tokens, GPU pool %d, host %d",
        a.preset, len(workload), mean_prompt, working_set, a.gpu_kv_tokens, a.host_kv_tokens,
    )  # fmt: skip
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out"}
    results: dict = {
        "preset": a.preset,
        "args": args,
        "working_set_tokens": working_set,
        "configs": {},
    }
    names = a.configs.split(",")
    state: dict = {"names": names}
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            results["configs"][name] = {"skipped": "time budget spent"}
            log.info("%s: skipped (time budget spent)", name)
            continue
        log.info("%s: starting (%.0f s elapsed)", name, time.monotonic() - started)
        try:
            row = run_config(name, model, a, workload, corpus, params, deadline, state)
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next one
            row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log.error("%s failed: %s", name, row["error"])
        free_device_memory()  # after the except clause: its traceback held the engine
        results["configs"][name] = row
        shown = ("stats", "traceback", "replay", "paced", "capacity")
        log.info("%s: %s", name, {k: rounded(v) for k, v in row.items() if k not in shown})
        add_ratios(results, names)
        results["seconds"] = time.monotonic() - started
        if a.out:
            a.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    log.info("done in %.0f s", time.monotonic() - started)
    tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
