"""Overlapped engine steps (``EngineConfig.enable_async_scheduling``) on a device: the same
outputs as the synchronous loop, and what the overlap saves per decode step.

Two engines on one device (random weights of ``--model``'s shape, ``--layers`` of them),
one with the switch off, one with it on:

1. exactness: ``--num`` requests (token-id prompts of 20-200 tokens, 8-48 new tokens, every
   third one seeded random sampling, the rest greedy; half at the start, the others one every
   third step, one aborted after 5 tokens) driven step by step on each engine: every output's
   token ids and finish reason must be equal, or the run fails;
2. timing: ``--batch`` greedy requests of 64 prompt tokens and ``--tokens`` new tokens all at
   once, ``--repeats`` times per engine, alternating; wall time per forward step (best and
   median) and tokens/s. The difference is the host work per step that the overlap hides (on CPU the
   forward is synchronous, so both should match there).

    python bench/async_check.py --model /tmp/s5dev/data/model --device cpu --out /tmp/a.json
    python bench/async_check.py --model $DATA/model --layers 8 --out $OUT/async_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ragserve.generation import LLMEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="folder with config.json")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num", type=int, default=24, help="requests of the exactness run")
    ap.add_argument("--batch", type=int, default=32, help="requests of the timing run")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timing request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--cpu-threads", type=int, default=None, help="CPU: torch threads")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"--model {args.model}: no config.json there")
    if min(args.num, args.batch, args.tokens, args.repeats) < 1:
        sys.exit("--num, --batch, --tokens and --repeats must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = _model_folder(args.model, args.layers, Path(tmp))
        engines = {flag: _engine(folder, args, flag) for flag in (False, True)}
        result = {"device": engines[True].config.device, "model": str(args.model)}
        result["layers"] = engines[True].model_config.num_hidden_layers
        outputs = {flag: _exactness_run(engine, args.num) for flag, engine in engines.items()}
        mismatched = [r for r in outputs[False] if outputs[False][r] != outputs[True].get(r)]
        result["exactness"] = {"requests": len(outputs[False]), "mismatched": mismatched}
        print(f"exactness: {len(outputs[False])} requests, {len(mismatched)} differ", flush=True)
        result["timing"] = _timing(engines, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if mismatched:
        sys.exit(f"async check FAILED: outputs differ for {mismatched}")


def _model_folder(src: Path, layers: int | None, tmp: Path) -> Path:
    """A copy of ``src``'s config (``layers`` overriding its depth) and tokenizer files."""
    out = tmp / "model"
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def _engine(folder: Path, args, overlap: bool) -> LLMEngine:
    return LLMEngine(
        folder,
        load_format="dummy",
        device=args.device,
        max_model_len=512,
        max_num_seqs=max(args.batch, args.num),
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        enable_prefix_caching=False,  # NOTE: both engines compute every token the same way
        enable_async_scheduling=overlap,
        cpu_threads=args.cpu_threads,
    )


def _exactness_run(engine: LLMEngine, num: int) -> dict[str, tuple]:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    requests = []
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 200))]
        n = rng.randint(8, 48)
        params = (
            SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
            if i % 3 == 0
            else SamplingParams(max_tokens=n, ignore_eos=True)
        )
        requests.append((f"r{i}", prompt, params))
    pending = list(requests[num // 2 :])
    for rid, prompt, params in requests[: num // 2]:
        engine.add_request(rid, prompt, params)
    final: dict[str, tuple] = {}
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % 3 == 0:
            engine.add_request(*pending.pop(0))
        step += 1
        for out in engine.step():
            final[out.request_id] = (tuple(out.token_ids), out.finish_reason)
            if out.request_id == "r1" and len(out.token_ids) >= 5 and not out.finished:
                engine.abort("r1")
    return final


def _timing(engines: dict[bool, LLMEngine], args) -> dict:
    rng = random.Random(1)
    vocab = engines[True].model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for engine in engines.values():  # warm-up: kernels, graphs, allocator
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(args.repeats):
        for flag, engine in engines.items():
            for i, p in enumerate(prompts):
                engine.add_request(f"t{i}", p, params)
            steps, start = 0, time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            seconds = time.perf_counter() - start
            runs[flag].append({"seconds": seconds, "steps": steps})
    out = {}
    for flag, rows in runs.items():
        name = "overlapped" if flag else "synchronous"
        # NOTE: per forward (``--tokens`` of them); the overlapped loop makes one more call
        per_step = [1e3 * r["seconds"] / args.tokens for r in rows]
        out[name] = {
            "ms_per_step_best": min(per_step),
            "ms_per_step_median": statistics.median(per_step),
            "tokens_per_s_best": args.batch * args.tokens / min(r["seconds"] for r in rows),
            "runs": rows,
        }
        print(
            f"timing {name}: {min(per_step):.3f} ms per forward step (best of {len(rows)}; "
            f"median {statistics.median(per_step):.3f}), "
            f"{out[name]['tokens_per_s_best']:.0f} tokens/s, batch {args.batch}",
            flush=True,
        )
    ratio = out["overlapped"]["ms_per_step_best"] / out["synchronous"]["ms_per_step_best"]
    out["overlapped_over_synchronous_best"] = ratio
    print(f"timing: overlapped / synchronous per step {ratio:.3f} (best of each)", flush=True)
    return out


if __name__ == "__main__":
    main()
