"""Attention backends on the Llama-3.1-8B attention shape (32 q heads, 8 kv heads, dim 128).

Decode: one query per sequence over a 1k-token paged context, batch 1..256; the figure is GPU
time per layer call and the KV bytes it must read over that time. Prefill: 8 prompts of 1,024
new tokens, and a 512-token chunk after a 2,048-token cached prefix. Triton tile configs are
swept; ``auto`` in ``generation/attention/base.py`` (``resolve_backend``) and the default configs in
``triton_backend.py`` come from this table.

    PYTHONPATH=src python bench/bench_attention.py --out results/attention.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_peaks import peaks, time_cuda  # noqa: E402
from ragserve.generation.attention.base import AttentionMetadata, get_backend  # noqa: E402
from ragserve.generation.attention.triton_backend import (  # noqa: E402
    KernelConfig,
    TritonBackend,
    unified_attention,
)

H, KVH, D, PAGE = 32, 8, 128, 16
L2_FLUSH_BYTES = 256 << 20  # rotate over enough "layers" that the KV working set exceeds L2


def make_batch(lens: list[tuple[int, int]], layers: int, dtype=torch.bfloat16):
    """Metadata over shuffled pages and ``layers`` separate caches of that batch."""
    blocks = [-(-s // PAGE) for _, s in lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used, slots, qsl = 0, [], [0]
    for i, ((q_len, seq_len), nb) in enumerate(zip(lens, blocks, strict=True)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        slots += [
            int(tables[i, t // PAGE]) * PAGE + t % PAGE for t in range(seq_len - q_len, seq_len)
        ]
        qsl.append(qsl[-1] + q_len)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        query_lens_cpu=tuple(q for q, _ in lens),
        seq_lens_cpu=tuple(s for _, s in lens),
    )
    caches = [
        (torch.randn(num_blocks, PAGE, KVH, D, dtype=dtype, device="cuda"),
         torch.randn(num_blocks, PAGE, KVH, D, dtype=dtype, device="cuda"))
        for _ in range(layers)
    ]  # fmt: skip
    n = qsl[-1]
    qkv = [
        (torch.randn(n, H, D, dtype=dtype, device="cuda"),
         torch.randn(n, KVH, D, dtype=dtype, device="cuda"),
         torch.randn(n, KVH, D, dtype=dtype, device="cuda"))
        for _ in range(layers)
    ]  # fmt: skip
    return md, caches, qkv


def graph_time(fn, layers: int) -> float:
    """Seconds per call of ``fn(layer)``, replaying a CUDA graph of all layers (no launch gaps)."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):  # warm the graph pool's allocations
            fn(i)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(layers):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    return time_cuda(graph.replay, iters=20) / layers


def eager_time(fn, layers: int) -> float:
    return time_cuda(lambda: [fn(i) for i in range(layers)], iters=10) / layers


def layers_for(kv_bytes: int) -> int:
    return max(2, min(32, -(-L2_FLUSH_BYTES // max(1, kv_bytes))))


def bench_decode(batch: int, ctx: int, rows: list[dict]) -> None:
    kv_bytes = batch * ctx * KVH * D * 2 * 2
    layers = layers_for(kv_bytes)
    md, caches, qkv = make_batch([(1, ctx)] * batch, layers)
    scale = D**-0.5

    def record(name: str, seconds: float, mode: str) -> None:
        rows.append({"kind": "decode", "batch": batch, "ctx": ctx, "backend": name, "mode": mode,
                     "us": seconds * 1e6, "kv_gbps": kv_bytes / seconds / 1e9})  # fmt: skip

    configs = [KernelConfig(block_q=1, block_n=n, num_warps=w, num_stages=s)
               for n in (32, 64, 128) for w, s in ((4, 2), (4, 3), (8, 3))]  # fmt: skip
    configs += [KernelConfig(block_q=1, block_n=64, num_warps=4, num_stages=3, num_splits=sp)
                for sp in (1, 2, 4, 8, 16, 32)]  # fmt: skip
    for cfg in configs:
        fn = lambda i, cfg=cfg: unified_attention(
            qkv[i][0], *caches[i], md, scale, cfg, is_decode=True
        )
        record(f"triton[n{cfg.block_n},w{cfg.num_warps},s{cfg.num_stages},sp{cfg.num_splits}]",
               graph_time(fn, layers), "graph")  # fmt: skip
    for name in ("triton", "torch_ref"):
        backend = TritonBackend() if name == "triton" else get_backend(name)
        backend.prepare(md)
        fn = lambda i, b=backend: b.forward(*qkv[i], *caches[i], md, scale)
        try:
            record(name, eager_time(fn, layers), "eager")
        except Exception as exc:  # noqa: BLE001 - a backend failing is a result, not a crash
            rows.append({"kind": "decode", "batch": batch, "backend": name, "error": repr(exc)})


def bench_prefill(lens: list[tuple[int, int]], label: str, rows: list[dict]) -> None:
    md, caches, qkv = make_batch(lens, 4)
    scale = D**-0.5
    flops = sum(4 * q * (s - q + (q + 1) / 2) * H * D for q, s in lens)  # causal QK^T + PV

    def record(name: str, seconds: float) -> None:
        rows.append({"kind": "prefill", "case": label, "backend": name, "us": seconds * 1e6,
                     "tflops": flops / seconds / 1e12})  # fmt: skip

    for bq in (16, 32, 64):
        for bn, w in ((32, 4), (64, 4), (64, 8), (128, 8)):
            cfg = KernelConfig(block_q=bq, block_n=bn, num_warps=w, num_stages=3)
            fn = lambda i, cfg=cfg: unified_attention(
                qkv[i][0], *caches[i], md, scale, cfg, is_decode=False
            )
            try:
                record(f"triton[q{bq},n{bn},w{w}]", eager_time(fn, 4))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                rows.append({"kind": "prefill", "case": label, "backend": f"q{bq}n{bn}w{w}",
                             "error": repr(exc)[:200]})  # fmt: skip
    for name in ("torch_ref",):
        backend = get_backend(name)
        backend.prepare(md)
        fn = lambda i, b=backend: b.forward(*qkv[i], *caches[i], md, scale)
        try:
            record(name, eager_time(fn, 4))
        except Exception as exc:  # noqa: BLE001
            rows.append({"kind": "prefill", "case": label, "backend": name, "error": repr(exc)})
    if all(s == q for q, s in lens):  # no cached prefix: flash SDPA on contiguous q/k/v
        q = torch.randn(len(lens), H, lens[0][0], D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(len(lens), KVH, lens[0][0], D, dtype=torch.bfloat16, device="cuda")
        fn = lambda i: torch.nn.functional.scaled_dot_product_attention(
            q, k, k, is_causal=True, enable_gqa=True
        )
        record("sdpa_contiguous", eager_time(fn, 4))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", default="1,16,64,256")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("bench_attention")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "peaks": peaks(), "rows": []}  # fmt: skip
    log.info("peaks %s", result["peaks"])
    for batch in [int(b) for b in args.batches.split(",")]:
        bench_decode(batch, 1024, result["rows"])
    bench_prefill([(1024, 1024)] * 8, "8x1024", result["rows"])
    bench_prefill([(512, 2560)] * 4, "4x512 after 2048", result["rows"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        if "error" in row:
            log.info("%s", row)
        elif row["kind"] == "decode":
            log.info("decode b%-3d %-30s %-5s %8.1f us %7.0f GB/s", row["batch"], row["backend"],
                     row["mode"], row["us"], row["kv_gbps"])  # fmt: skip
        else:
            log.info("prefill %-17s %-22s %8.1f us %6.1f TFLOP/s", row["case"], row["backend"],
                     row["us"], row["tflops"])  # fmt: skip


if __name__ == "__main__":
    main()
