"""Cache fusion's first use of passages: TTFT of a fused request whose passages all miss, with a
request's misses computed in one packed forward (``fusion_batch_misses``, the default) against
one forward per passage (the switch off), interleaved on one engine each.

Each request: a fixed instruction prefix, ``--topk`` passages never seen before (fresh keys and
tokens, so every one misses) of ``--passage-tokens`` tokens, a question; ``fusion_ratio``
``--ratio``; one token generated. Reported per side: mean and median TTFT over ``--reps``
requests (after one warm-up each) and the ratio.

    PYTHONPATH=src python bench/fusion_misses.py --model smollm2-135m-instruct --reps 12
    # GPU (Llama-3.1-8B shape, random weights): --model <folder> --device cuda --dummy
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def fused_prompt(rng: random.Random, args, vocab: int):
    from ragserve.generation import Segment

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    passages = [
        Segment(toks(args.passage_tokens), key=f"p{rng.random()}") for _ in range(args.topk)
    ]
    return [Segment(toks(24)), *passages, Segment(toks(16))]


def ttft(engine, prompt, ratio: float) -> float:
    from ragserve.generation import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(
        f"r{t0}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), fusion_ratio=ratio
    )
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy (random weights)")
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--passage-tokens", type=int, default=100)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from ragserve.generation import LLMEngine

    kw = dict(device=args.device, dtype=args.dtype, max_model_len=4096)
    if args.dummy:
        kw["load_format"] = "dummy"
    engines = {b: LLMEngine(args.model, fusion_batch_misses=b, **kw) for b in (True, False)}
    vocab = engines[True].model_config.vocab_size
    rng = random.Random(args.seed)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps + 1):
        for batch in (True, False) if rep % 2 else (False, True):  # interleaved, order alternating
            t = ttft(engines[batch], fused_prompt(rng, args, vocab), args.ratio)
            if rep:  # the first of each side warms up
                times[batch].append(t)
    result = {"argv": sys.argv[1:] if argv is None else argv}
    for name, batch in (("batched", True), ("per_passage", False)):
        result[name] = {"mean_s": statistics.mean(times[batch]),
                        "median_s": statistics.median(times[batch])}  # fmt: skip
    result["per_passage_over_batched_median"] = (
        result["per_passage"]["median_s"] / result["batched"]["median_s"]
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
