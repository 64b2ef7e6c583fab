"""Cache fusion TTFT and throughput vs full prefill and exact prefix reuse (H200 preset).

Workload: a pool of ``--docs`` passages of ``--passage-tokens`` tokens; each request holds a
fixed instruction prefix, ``--topk`` distinct passages in a random order and a fresh
``--question-tokens`` question, greedy, ``--max-tokens`` out. The passage store is warmed
first (each passage's KV computed once, the offline step of cache fusion), then per
configuration:

- TTFT: requests one at a time, mean / p90 time to first token;
- throughput: ``--num-requests`` at once, completed requests per second.

Configurations: ``full`` (no reuse), ``prefix`` (knowledge tree: exact reuse only where a
prompt repeats an earlier prefix, i.e. the instructions here since orders are shuffled),
and ``fuse-<selector>-<r>`` for r in ``--ratios``.

    # H200, Llama-3.1-8B shape with random weights (not run yet: no device for issue 13)
    PYTHONPATH=src python bench/bench_fusion.py --preset h200-llama8b --out fusion_h200.json
    # CPU smoke check of the script (tiny shape)
    PYTHONPATH=src python bench/bench_fusion.py --preset cpu-smoke
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
from bench_engine import LLAMA_31_8B  # noqa: E402
from ragserve.generation import LLMEngine, SamplingParams, Segment  # noqa: E402

log = logging.getLogger("bench_fusion")

SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024)  # fmt: skip
PRESETS = {
    "h200-llama8b": dict(config=LLAMA_31_8B, device="cuda", dtype="bfloat16", docs=40,
                         passage_tokens=1024, topk=5, question_tokens=32, prefix_tokens=32,
                         num_ttft=20, num_requests=64, max_tokens=32, kv_gb=40.0),
    "cpu-smoke": dict(config={**LLAMA_31_8B, **SMOKE}, device="cpu", dtype="float32", docs=8,
                      passage_tokens=64, topk=3, question_tokens=8, prefix_tokens=8,
                      num_ttft=4, num_requests=4, max_tokens=4, kv_gb=0.05),
}  # fmt: skip
RATIOS = (0.0, 0.05, 0.10, 0.15, 0.30, 1.0)


def workload(p: dict, n: int, seed: int) -> list[list[Segment]]:
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


def run(engine: LLMEngine, requests, ratio, max_tokens: int, together: bool) -> list[float]:
    """TTFTs (seconds) of the requests, run one at a time or all at once."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    batches = [requests] if together else [[r] for r in requests]
    ttfts = []
    for batch in batches:
        for i, segs in enumerate(batch):
            engine.add_request(f"r{i}", segs, params, fusion_ratio=ratio)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    ttfts.append(out.metrics.ttft)
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--selectors", default="qcfuse,cacheblend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = PRESETS[a.preset]
    folder = Path(tempfile.mkdtemp()) / "llama-3.1-8b-random"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(p["config"]))
    ttft_reqs = workload(p, p["num_ttft"], a.seed)
    batch_reqs = workload(p, p["num_requests"], a.seed + 1)
    configs = [("full", None, None), ("prefix", None, None)]
    for sel in a.selectors.split(","):
        configs += [(f"fuse-{sel}-{r}", sel, float(r)) for r in a.ratios.split(",")]
    result: dict = {"preset": a.preset, "configs": {}}
    for name, selector, ratio in configs:
        engine = LLMEngine(
            folder, device=p["device"], dtype=p["dtype"], load_format="dummy",
            max_model_len=8192, kv_cache_bytes=int(p["kv_gb"] * 2**30),
            enable_prefix_caching=name != "full", fusion_selector=selector or "qcfuse",
        )  # fmt: skip
        run(engine, workload(p, 2, a.seed + 2), ratio, 1, together=False)  # warm-up
        if ratio is not None:  # the offline step: every passage stored once
            run(engine, ttft_reqs + batch_reqs, 0.0, 1, together=True)
        ttft = run(engine, ttft_reqs, ratio, 1, together=False)
        start = time.perf_counter()
        run(engine, batch_reqs, ratio, p["max_tokens"], together=True)
        wall = time.perf_counter() - start
        row = {
            "ttft_mean_s": float(np.mean(ttft)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "throughput_req_s": len(batch_reqs) / wall,
            "stats": engine.stats(),
        }
        result["configs"][name] = row
        log.info("%s: %s", name, {k: v for k, v in row.items() if k != "stats"})
        del engine
    base = result["configs"]["full"]["ttft_mean_s"]
    for row in result["configs"].values():
        row["ttft_speedup_vs_full"] = base / row["ttft_mean_s"]
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
