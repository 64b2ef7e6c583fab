"""Hardware ceilings measured in the same run as a benchmark: HBM copy bandwidth, bf16 matmul."""

from __future__ import annotations

import torch


def time_cuda(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * num_bytes / seconds


def matmul_flops(n: int = 8192) -> float:
    """bf16 ``n x n x n`` matmul rate in FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = time_cuda(lambda: a @ b, iters=20)
    return 2 * n**3 / seconds


def peaks() -> dict[str, float]:
    result = {"copy_bytes_per_s": copy_bandwidth(), "bf16_matmul_flops": matmul_flops()}
    torch.cuda.empty_cache()
    return result
