"""Per-call host costs of issue 16's fifth-pass cuts, ratios on one machine (interleaved).

1. ``detokenize``: the engine's per-token postprocessing (append, incremental detokenize,
   finish check, output snapshot) with ``enable_fast_detokenize`` off vs on (``make_decoder``),
   a 300-token prompt and 32 random output tokens per sequence; the texts must be identical.
2. ``drain``: a worker's non-blocking read of an empty inbox (``workers._drain``), the
   ``--old-src`` tree's vs this one's, in a spawned child (a real parent process and
   ``multiprocessing.Queue``).

    python bench/host_costs.py --tokenizer DIR --old-src /tmp/main/src [--out OUT.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def detokenize_costs(tokenizer_dir: str, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from ragserve.generation.detokenizer import (
        IncrementalDetokenizer,
        check_finished,
        make_decoder,
    )
    from ragserve.generation.sampling_params import SamplingParams
    from ragserve.generation.sequence import Sequence

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(0)
    prompt = [rng.randrange(len(tok)) for _ in range(300)]
    outs = [[rng.randrange(len(tok)) for _ in range(32)] for _ in range(40)]

    def run(fast: bool) -> tuple[float, list[str]]:
        decode, texts = make_decoder(tok, fast), []
        t0 = time.perf_counter()
        for out in outs:
            seq = Sequence("r", prompt, SamplingParams(max_tokens=32))
            detok = IncrementalDetokenizer(tok, seq, decode)
            for t in out:
                seq.append_token(t)
                detok.update(seq)
                check_finished(seq, t, (), 1 << 20)
                seq.to_output()
            texts.append(seq.text)
        return (time.perf_counter() - t0) / (len(outs) * 32) * 1e6, texts

    us: dict[bool, list[float]] = {False: [], True: []}
    texts = {}
    for _ in range(repeats):
        for fast in (False, True):
            t, texts[fast] = run(fast)
            us[fast].append(t)
    if texts[True] != texts[False]:
        raise SystemExit("fast detokenization changed a text")
    off, on = statistics.median(us[False]), statistics.median(us[True])
    return {"us_per_token_off": off, "us_per_token_on": on, "on_over_off": on / off}


def _drain_of(src: str):
    for name in [m for m in sys.modules if m == "ragserve" or m.startswith("ragserve.")]:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        return importlib.import_module("ragserve.runtime.workers")._drain
    finally:
        sys.path.remove(src)


def _drain_child(inbox, out, old_src: str, new_src: str, repeats: int) -> None:
    drains = {"old": _drain_of(old_src), "new": _drain_of(new_src)}
    us: dict[str, list[float]] = {"old": [], "new": []}
    n = 5000
    for _ in range(repeats):
        for label, drain in drains.items():
            t0 = time.perf_counter()
            for _ in range(n):
                drain(inbox, False)
            us[label].append((time.perf_counter() - t0) / n * 1e6)
    out.put(us)


def drain_costs(old_src: str, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    inbox, out = ctx.Queue(8), ctx.Queue()
    child = ctx.Process(target=_drain_child, args=(inbox, out, old_src, str(SRC), repeats))
    child.start()
    us = out.get()
    child.join()
    old, new = statistics.median(us["old"]), statistics.median(us["new"])
    return {"us_per_read_old": old, "us_per_read_new": new, "new_over_old": new / old}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a model folder with tokenizer.json")
    ap.add_argument("--old-src", required=True, help="the src/ folder to compare the drain with")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(SRC))
    result = {
        "detokenize": detokenize_costs(args.tokenizer, args.repeats),
        "drain": drain_costs(str(Path(args.old_src).resolve()), args.repeats),
    }
    d, r = result["detokenize"], result["drain"]
    print(
        f"postprocess per token: fast detokenize off {d['us_per_token_off']:.1f} us, on "
        f"{d['us_per_token_on']:.1f} us, on/off {d['on_over_off']:.2f} (texts identical)"
    )
    print(f"non-blocking inbox read: old {r['us_per_read_old']:.1f} us, this tree "
          f"{r['us_per_read_new']:.1f} us, new/old {r['new_over_old']:.2f}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
