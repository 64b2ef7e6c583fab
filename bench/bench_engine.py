"""The LLM engine on one GPU: Llama-3.1-8B architecture, random bf16 weights, one run.

Measured side by side, with the ceilings measured in the same run (``gpu_peaks.py``):

- decode step latency at batch 1/16/64/256 over 1k-token contexts (engine ``step()`` end to
  end, and the model forward alone, with and without CUDA graphs), next to the bound
  (weight bytes + KV bytes) / copy bandwidth;
- prefill tokens/s for 1k-token prompts next to the bf16 matmul peak (FLOPs = 2 x decoder
  parameters per token + causal attention);
- offline throughput (N requests, 1024 in / 128 out) against ``transformers`` on the same GPU
  with the same weights: ``generate_batch`` (its continuous batching) and plain ``generate``.

    PYTHONPATH=src python bench/bench_engine.py --out results/engine.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from dummy_engine import LLAMA_31_8B, SMOKE, dummy_folder  # noqa: E402
from gpu_peaks import peaks  # noqa: E402
from ragserve.generation import LLMEngine, SamplingParams  # noqa: E402

log = logging.getLogger("bench_engine")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 120000, (n, length), generator=g).tolist()


def sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def model_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step must read: every parameter but the embedding table (rows only)."""
    model = engine.model_runner.model
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name
    )


def kv_bytes(engine: LLMEngine, tokens: int) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * tokens


def bench_decode(engine: LLMEngine, batch: int, ctx: int, bw: float, steps: int = 20) -> dict:
    """Fill ``batch`` sequences to ``ctx`` tokens, then time decode steps."""
    # NOTE: early sequences decode while later ones still prefill, so leave room for it
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i, p in enumerate(prompts(batch, ctx - 1, seed=batch)):
        engine.add_request(f"d{batch}-{i}", p, params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
        engine.step()  # prefill (chunked) until every sequence has its first token
    engine.step()  # first decode (all sequences now have ctx tokens in flight)
    context = sum(s.num_tokens for s in sched.running) + batch * steps // 2  # mean over steps
    start = sync_time()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch, f"decode step advanced {len(outs)} of {batch}"
    step_s = (sync_time() - start) / steps
    # model forward alone on the next decode batch, graphs on and off
    runner = engine.model_runner
    out = engine.scheduler.schedule()
    ids, pos, md, _ = runner.prepare_inputs(out)
    times = {}
    for mode in ("graph", "eager"):
        graphs = runner.graph_runner
        if mode == "eager":
            runner.graph_runner = None
        elif graphs is None:
            continue
        with torch.inference_mode():
            for _ in range(3):
                runner.run_model(ids, pos, md)
            start = sync_time()
            for _ in range(steps):
                runner.run_model(ids, pos, md)
            times[mode] = (sync_time() - start) / steps
        runner.graph_runner = graphs
    kernels = kernel_profile(runner, ids, pos, md) if batch == 1 else {}
    engine.scheduler.update_after_step(out)
    for s in list(engine.scheduler.running):
        engine.abort(s.request_id)
    bound = (model_bytes(engine) + kv_bytes(engine, context)) / bw
    row = {"batch": batch, "ctx": ctx, "mean_ctx": context / batch, "engine_step_ms": step_s * 1e3,
           "forward_graph_ms": times.get("graph", float("nan")) * 1e3,
           "forward_eager_ms": times["eager"] * 1e3, "bound_ms": bound * 1e3,
           "step_over_bound": step_s / bound, **kernels}  # fmt: skip
    log.info("decode %s", row)
    return row


def kernel_profile(runner, ids, pos, md) -> dict:
    """GPU kernels of one eager forward: count, summed kernel time, the heaviest names."""
    from torch.profiler import ProfilerActivity, profile

    if not ids.is_cuda:
        return {}
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run_model(ids, pos, md)
            torch.cuda.synchronize()
    finally:
        runner.graph_runner = graphs
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels_per_forward": len(events),
            "kernel_time_ms": sum(e.device_time for e in events) / 1e3,
            "top_kernels_us": {k: round(v, 1) for k, v in top}}  # fmt: skip


def flops_per_token(engine: LLMEngine, ctx: int) -> float:
    """Prefill FLOPs per prompt token: 2 x the decoder's parameters (``lm_head`` runs on the
    last token only, so it is left out) plus causal attention (QK^T and PV)."""
    cfg = engine.model_config
    lm_head = cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (ctx + 1) / 2
    return 2 * (model_bytes(engine) / 2 - lm_head) + attn  # bf16: parameters = bytes / 2


def bench_prefill(engine: LLMEngine, n: int, length: int, peak: float) -> dict:
    """Time ``n`` prompts of ``length`` tokens (one output token each) after a warm-up set."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate(prompts(8, length, seed=6), params)  # warm-up: prefill kernels compiled
    reqs = prompts(n, length, seed=7)
    start = sync_time()
    engine.generate(reqs, params)
    seconds = sync_time() - start
    rate = n * length / seconds
    flops = rate * flops_per_token(engine, length)
    row = {"prompts": n, "length": length, "seconds": seconds, "tokens_per_s": rate,
           "tflops": flops / 1e12, "fraction_of_peak": flops / peak}  # fmt: skip
    log.info("prefill %s", row)
    return row


def bench_offline(engine: LLMEngine, n: int, inp: int, out: int) -> dict:
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    reqs = prompts(n, inp, seed=11)
    start = sync_time()
    results = engine.generate(reqs, params)
    seconds = sync_time() - start
    assert all(len(r.token_ids) == out for r in results)
    row = {"requests": n, "input": inp, "output": out, "seconds": seconds,
           "output_tokens_per_s": n * out / seconds,
           "total_tokens_per_s": n * (inp + out) / seconds,
           "preemptions": engine.stats()["preemptions"]}  # fmt: skip
    log.info("offline %s", row)
    return row


def build_hf(engine: LLMEngine, folder: Path):
    """transformers' Llama from the same config, holding the engine's weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(folder)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(engine.model_runner.device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    ours = engine.model_runner.model
    state = hf.state_dict()
    # NOTE: the engine's ``load_weight`` takes HF-named tensors, so HF's own random init is
    # copied into the engine: from here on both models hold the same weights.
    used = {name for name, tensor in state.items() if ours.load_weight(name, tensor)}
    missing = ours.expected_weight_names() - used
    assert not missing, f"weights not shared: {sorted(missing)[:5]}"
    return hf.eval()


def bench_hf(hf, engine: LLMEngine, n: int, inp: int, out: int) -> dict:
    from transformers import GenerationConfig

    result: dict = {}
    device = engine.model_runner.device
    prompt = torch.tensor(prompts(1, inp, seed=3), device=device)
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    gen["attention_mask"] = torch.ones_like(prompt)
    hf.generate(prompt, max_new_tokens=2, **gen)  # warm-up
    start = sync_time()
    hf.generate(prompt, max_new_tokens=1, **gen)
    result["prefill_ms"] = (sync_time() - start) * 1e3
    new = 32
    start = sync_time()
    hf_tokens = hf.generate(prompt, max_new_tokens=new, **gen)[0, inp:].tolist()
    total = sync_time() - start
    result["generate_b1_ms_per_token"] = (total * 1e3 - result["prefill_ms"]) / (new - 1)
    ours = engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=new, ignore_eos=True))
    result["greedy_tokens_equal_ours"] = sum(
        a == b for a, b in zip(hf_tokens, ours[0].token_ids, strict=False)
    )
    reqs = prompts(n, inp, seed=11)
    batch = torch.tensor(reqs, device=device)
    start = sync_time()
    gen["attention_mask"] = torch.ones_like(batch)
    hf.generate(batch, max_new_tokens=out, **gen)
    seconds = sync_time() - start
    result["generate_batched"] = {"requests": n, "seconds": seconds,
                                  "output_tokens_per_s": n * out / seconds}  # fmt: skip
    cfg = GenerationConfig(max_new_tokens=out, do_sample=False, eos_token_id=None,
                           pad_token_id=0)  # fmt: skip
    start = sync_time()
    outs = hf.generate_batch(reqs, generation_config=cfg)
    seconds = sync_time() - start
    made = sum(len(o.generated_tokens) for o in outs.values())
    # requests are created after its warm-up (CUDA graph capture): time them on their own too
    window = max(o.lifespan[1] for o in outs.values()) - min(o.created_time for o in outs.values())
    result["generate_batch"] = {"requests": n, "seconds_with_warmup": seconds,
                                "seconds": window, "output_tokens": made,
                                "output_tokens_per_s": made / window}  # fmt: skip
    log.info("transformers %s", result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--ctx", type=int, default=1024, help="decode context length")
    parser.add_argument("--prefill-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--offline-requests", type=int, default=512)
    parser.add_argument("--hf-requests", type=int, default=64)
    parser.add_argument("--kv-gb", type=float, default=48.0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result: dict = {"torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.smoke:
        result["peaks"] = {"copy_bytes_per_s": float("nan"), "bf16_matmul_flops": float("nan")}
        device, dtype, config = "cpu", "float32", {**LLAMA_31_8B, **SMOKE}
    else:
        result["device"] = torch.cuda.get_device_name()
        result["peaks"] = peaks()
        device, dtype, config = "cuda", "bfloat16", LLAMA_31_8B
    log.info("peaks %s", result["peaks"])

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    folder = dummy_folder(Path(tempfile.mkdtemp()) / "llama-3.1-8b-random", config)
    start = time.perf_counter()
    engine = LLMEngine(
        folder, device=device, dtype=dtype, load_format="dummy", max_model_len=2048,
        max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_bytes=int(args.kv_gb * 2**30),
        enable_prefix_caching=False,
    )  # fmt: skip
    result["engine_init_s"] = time.perf_counter() - start
    result["backend"] = engine.model_runner.backend.name
    result["weight_bytes"] = model_bytes(engine)
    bw, peak = result["peaks"]["copy_bytes_per_s"], result["peaks"]["bf16_matmul_flops"]
    batches = [int(b) for b in args.batches.split(",")]
    result["decode"] = [bench_decode(engine, b, args.ctx, bw) for b in batches]
    save()
    result["prefill"] = bench_prefill(engine, args.prefill_prompts, args.input_len, peak)
    save()
    inp, out = args.input_len, args.output_len
    result["offline"] = bench_offline(engine, args.offline_requests, inp, out)
    result["offline_hf_size"] = bench_offline(engine, args.hf_requests, inp, out)
    save()
    if not args.skip_hf:
        try:
            hf = build_hf(engine, folder)
            result["transformers"] = bench_hf(hf, engine, args.hf_requests, inp, out)
        except Exception as exc:  # noqa: BLE001 - keep the engine figures if the baseline fails
            log.exception("transformers baseline failed")
            result["transformers"] = {"error": repr(exc)}
        save()
    log.info("RESULT %s", json.dumps(result))


if __name__ == "__main__":
    main()
