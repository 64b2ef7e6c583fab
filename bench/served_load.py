"""Open-loop HTTP load for ``bench/served_capacity.py``, and what is sampled beside it.

``run_load`` sends OpenAI chat requests (``model`` = a workflow name, streamed) at given
arrival offsets from ONE asyncio loop in this process (aiohttp, no connection limit), never
waiting for an answer before the next arrival: latency counts from the scheduled arrival,
so a client that falls behind shows as latency, not as a lower rate. A request unfinished
``drain_s`` after the last arrival is cut (its connection closed: the server aborts it) and
counts as a miss. ``Utilisation`` samples the host's CPU (psutil, all cores) and the GPU's
busy share (NVML, else ``nvidia-smi``) every ``period_s`` on a thread.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Result:
    """One request: ``arrival`` (scheduled offset, s), ``finish_time`` (monotonic), ``latency``
    (scheduled arrival to the stream's end), ``ttft`` (to the first answer text), ``error``."""

    workflow: str
    arrival: float
    finish_time: float
    latency: float
    ttft: float | None
    error: str | None


async def _one(session, url: str, start: float, t: float, model: str, question: str,
               extra: dict, deadline: float) -> Result:  # fmt: skip
    await asyncio.sleep(max(0.0, start + t - time.monotonic()))
    t0 = start + t
    body = {"model": model, "messages": [{"role": "user", "content": question}], "stream": True}
    body.update(extra)
    first = None
    error = None
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    error = f"http {resp.status}: {(await resp.text())[:200]}"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = str(obj["error"].get("message", obj["error"]))[:200]
                            continue
                        choices = obj.get("choices") or [{}]
                        if first is None and choices[0].get("delta", {}).get("content"):
                            first = time.monotonic()
    except TimeoutError:
        error = "timeout"
    except Exception as exc:  # a refused or reset connection fails this request alone
        error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.monotonic()
    return Result(model, t, end, end - t0, None if first is None else first - t0, error)


async def _run(url: str, schedule: list[tuple[float, str, str]], drain_s: float,
               extra: dict) -> tuple[list[Result], float]:  # fmt: skip
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic() + 0.1
        deadline = start + schedule[-1][0] + drain_s
        tasks = [_one(session, url, start, t, m, q, extra, deadline) for t, m, q in schedule]
        results = await asyncio.gather(*tasks)
    return list(results), start


def run_load(url: str, schedule: list[tuple[float, str, str]], *, drain_s: float,
             extra: dict | None = None) -> tuple[list[Result], float]:  # fmt: skip
    """``schedule``: ``(offset s, model, question)`` sorted by offset. Returns the results in
    schedule order and the start (monotonic s) the offsets count from."""
    if not schedule:
        raise ValueError("empty schedule")
    return asyncio.run(_run(url, schedule, drain_s, dict(extra or {})))


def poisson_schedule(rate: float, duration: float, models: list[str], questions: list[str],
                     seed: int, offset: int = 0) -> list[tuple[float, str, str]]:  # fmt: skip
    """Poisson arrivals at ``rate`` over ``duration`` s; the models in equal shares (each block
    of ``len(models)`` arrivals is one shuffled copy of them); questions from ``offset`` on."""
    rng = np.random.default_rng(seed)
    n = int(rate * duration * 1.5) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    times = times[times <= duration]
    if len(times) < 2:
        times = np.array([0.0, duration / 2])
    blocks = -(-len(times) // len(models))
    order = np.concatenate([rng.permutation(len(models)) for _ in range(blocks)])
    return [
        (float(t), models[int(order[i])], questions[(offset + i) % len(questions)])
        for i, t in enumerate(times)
    ]


def percentile(values: list[float], q: float) -> float | None:
    """``q``-th percentile; ``inf`` entries (misses) count as slower than any finished one."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="higher"))


class Utilisation:
    """Mean host CPU and GPU busy share (%) over a window, sampled on a thread."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float | None, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="utilisation", daemon=True)
        self._nvml = None

    def _gpu_sample(self) -> tuple[float, float] | None:
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = ("nvml", pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
            except Exception:
                self._nvml = ("smi", None, shutil.which("nvidia-smi"))
        kind, lib, handle = self._nvml
        if kind == "nvml":
            util = lib.nvmlDeviceGetUtilizationRates(handle)
            mem = lib.nvmlDeviceGetMemoryInfo(handle)
            return float(util.gpu), mem.used / 1e9
        if handle is None:
            return None
        out = subprocess.run(
            [handle, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        util, mem = out.stdout.splitlines()[0].split(",")
        return float(util), float(mem) / 1e3

    def _loop(self) -> None:
        import psutil

        psutil.cpu_percent(None)
        while not self._stop.wait(self.period_s):
            cpu = psutil.cpu_percent(None)
            try:
                gpu, mem = self._gpu_sample() or (None, None)
            except Exception:
                gpu, mem = None, None
            self.samples.append((time.monotonic(), cpu, gpu, mem))

    def __enter__(self) -> Utilisation:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def summary(self, t0: float = 0.0, t1: float = float("inf")) -> dict:
        """Means over the samples taken in ``[t0, t1]`` (monotonic s)."""
        rows = [s for s in self.samples if t0 <= s[0] <= t1]

        def mean(i: int) -> float | None:
            xs = [r[i] for r in rows if r[i] is not None]
            return round(float(np.mean(xs)), 1) if xs else None

        mem = [r[3] for r in rows if r[3] is not None]
        return {
            "cpu_util_pct": mean(1),
            "gpu_util_pct": mean(2),
            "gpu_mem_gb": round(max(mem), 1) if mem else None,
            "util_samples": len(rows),
        }
