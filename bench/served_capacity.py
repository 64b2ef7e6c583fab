"""Capacity of the served system (issue 28): ``ragserve serve`` under open-loop HTTP load.

One server process is started as a user starts ``ragserve serve`` (``bench/served_server.py``:
the CLI's own parser, config and Server; a config file names the model, the index and the
engine; ``--gpu-index-gb`` turns the GPU index tier on; co-scheduling, the knowledge tree and
cache-aware admission are the shipped defaults). This process is the load generator
(``served_load.py``): Poisson arrivals of the five workflows in equal shares (``model`` = the
workflow's name, streamed), ``--warmup`` s then a ``--window`` s measured window per rate,
rates rising until p90 passes ``--stop-factor`` x the lowest rate's p90. Systems, on the same
server, prompts, seed and arrivals:

- ``ragserve``: the shipped defaults (nothing switched);
- ``llm-alone``: the same engine, the workflows' generation nodes with the passages already
  in their prompts, no retrieval (the roofline);
- ``baseline``: what a user builds today: the same engine, exhaustive search on the GPU (every
  list probed, ``nprobe`` = ``nlist``, on the tier holding the whole index: a torch matmul over
  the corpus), no co-scheduling, no KV reuse;
- ablations: ``no-cosched``, ``no-kv-reuse``, ``no-tier`` (each one feature off),
  ``cosched-all`` (every co-scheduling transform forced on: co-scheduling ``auto``, shipped,
  turns them off when the tier holds the index) and ``fusion-on`` (cache fusion is off as
  shipped: no built-in workflow sets ``fusion_ratio``);
- ``ragserve-again``: the shipped defaults once more, run last (a drift check).

Switches go through ``POST /bench/control`` between points (the KV cache is emptied before
every point). Sustained: completed >= 95 % of offered and >= 90 % within the SLO
(``sustained.py``). Writes ``results.json`` after every point and ``served_capacity.png``.

    python bench/served_capacity.py --preset h200 --out /root/served ...   # bench/h200_served.sh
    python bench/served_capacity.py --preset smoke --in-process ...        # the CPU test
    python bench/served_capacity.py --report results.json                  # tables
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from rag_setup import PRESETS, prepare  # noqa: E402
from served_load import Utilisation, percentile, poisson_schedule, run_load  # noqa: E402
from served_workflows import NAMES, workflow_flags  # noqa: E402
from sustained import find_capacity, is_sustained, window_stats  # noqa: E402

logger = logging.getLogger("served_capacity")
EXHAUSTIVE = "exhaustive"
# system -> (model prefix, co-scheduling, KV reuse, GPU tier, per-request extras)
SYSTEMS: dict[str, dict] = {
    "ragserve": {"prefix": "", "cosched": "auto", "kv_reuse": True, "tier": True},
    "llm-alone": {"prefix": "llm-", "cosched": "auto", "kv_reuse": True, "tier": True},
    "no-cosched": {"prefix": "", "cosched": "off", "kv_reuse": True, "tier": True},
    "no-kv-reuse": {"prefix": "", "cosched": "auto", "kv_reuse": False, "tier": True},
    "fusion-on": {"prefix": "fused-", "cosched": "auto", "kv_reuse": True, "tier": True},
    "baseline": {
        "prefix": "",
        "cosched": "off",
        "kv_reuse": False,
        "tier": True,
        "nprobe": EXHAUSTIVE,
    },  # fmt: skip
    # the transforms forced on (the default before `auto`): what `auto` turned off
    "cosched-all": {"prefix": "", "cosched": "all", "kv_reuse": True, "tier": True},
    "no-tier": {"prefix": "", "cosched": "auto", "kv_reuse": True, "tier": False},
    # the shipped defaults again, run last: whether the server drifted over the run
    "ragserve-again": {"prefix": "", "cosched": "auto", "kv_reuse": True, "tier": True},
}
ABLATIONS = ("no-cosched", "no-kv-reuse", "fusion-on", "cosched-all", "no-tier")


# -- the server --------------------------------------------------------------------------
def write_config(path: Path, data: dict, *, in_process: bool) -> Path:
    """The ``--config`` TOML a user would write: model, index, engine, default nprobe."""
    lines = [f"model = {json.dumps(data['model'])}", f"index = {json.dumps(data['index'])}", "",
             "[engine]"]  # fmt: skip
    for key, value in sorted(data["engine_kwargs"].items()):
        lines.append(f"{key} = {json.dumps(value)}")
    lines += ["", "[runtime]", f"default_nprobe = {int(data['nprobe'])}"]
    if in_process:
        lines.append("in_process = true")
    path.write_text("\n".join(lines) + "\n")
    return path


def _free_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(config: Path, port: int, args) -> list[str]:
    """``ragserve serve`` flags (through ``served_server.py``)."""
    cmd = [sys.executable, str(BENCH / "served_server.py"), "serve", "--config", str(config),
           "--port", str(port), "--max-inflight", str(args.max_inflight)]  # fmt: skip
    if args.tier_gb > 0:
        cmd += ["--gpu-index-gb", str(args.tier_gb), "--gpu-index-device", args.tier_device]
        cmd += ["--gpu-index-scan", args.tier_scan]
    return cmd + workflow_flags()


class ServedProcess:
    """The server subprocess: started, waited for (``/health`` 200), stopped with SIGTERM
    (uvicorn drains, then the app closes the Server)."""

    def __init__(self, cmd: list[str], log: Path, preset: str, start_timeout_s: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH")) if p)
        env["SERVED_PRESET"] = preset
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._log_file = log.open("w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)  # fmt: skip
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() - t0 > start_timeout_s:
                self.stop()
                raise RuntimeError(f"the server did not start in {start_timeout_s} s")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        self.start_s = time.monotonic() - t0
        logger.info("server up in %.1f s: %s", self.start_s, " ".join(cmd))

    def tail(self, n: int = 4000) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-n:]

    def control(self, **body) -> dict:
        """``POST /bench/control``; retried while the engine still finishes cut requests
        (``set_kv_reuse`` needs an idle engine)."""
        req = urllib.request.Request(
            f"{self.url}/bench/control", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        for attempt in range(30):
            try:
                with urllib.request.urlopen(req, timeout=900) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                if attempt == 29 or (self.proc is not None and self.proc.poll() is not None):
                    raise RuntimeError(f"control {body}: {exc}\n{self.tail()}") from exc
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log_file.close()


class InThreadServer:
    """``--server-mode thread``: the same server on a thread of this process (tests)."""

    def __init__(self, cmd: list[str], preset: str) -> None:
        from served_server import ThreadServed

        os.environ["SERVED_PRESET"] = preset
        t0 = time.monotonic()
        self._served = ThreadServed(cmd[cmd.index("serve") :])
        self.url = self._served.url
        self.start_s = time.monotonic() - t0
        self.proc = None

    control = ServedProcess.control

    def tail(self, n: int = 4000) -> str:
        return ""

    def stop(self) -> None:
        self._served.stop()


# -- one point ---------------------------------------------------------------------------
def _engine(reply: dict) -> dict:
    return reply["stats"].get("engine", {})


def _scans(before: dict, after: dict) -> dict[str, int] | None:
    """The GPU tier's scans per strategy between two control replies (None: no tier)."""
    s0, s1 = ((r.get("tier") or {}).get("scans") for r in (before, after))
    return None if s1 is None else {k: n - (s0 or {}).get(k, 0) for k, n in s1.items()}


def measure(server: ServedProcess, system: str, rate: float, data: dict, args,
            tier_state: list[bool]) -> dict:  # fmt: skip
    """One rate of one system: switch the server to the system, offer the load, summarize."""
    spec = SYSTEMS[system]
    body = {"cosched": spec["cosched"], "kv_reuse": spec["kv_reuse"]}  # empties the KV cache
    if spec["tier"] != tier_state[0] and args.tier_gb > 0:
        body["tier"] = spec["tier"]
    before = server.control(**body)
    tier_state[0] = spec["tier"] if "tier" in body else tier_state[0]
    extra = {}
    if spec.get("nprobe") == EXHAUSTIVE:
        extra["nprobe"] = int(data["nlist"])
    models = [spec["prefix"] + n for n in NAMES]
    seed = args.seed + int(round(rate * 1000))  # the same arrivals for every system
    schedule = poisson_schedule(rate, args.warmup + args.window, models, data["questions"], seed)
    with Utilisation(args.sample_s) as util:
        results, start = run_load(server.url, schedule, drain_s=args.drain, extra=extra)
    after = server.control()
    times = [t for t, _, _ in schedule]
    win = window_stats(results, times, start, args.warmup, args.slo)
    measured = [r for r in results if r.arrival >= args.warmup]
    lat = [r.latency if r.error is None else float("inf") for r in measured]
    ttft = [r.ttft for r in measured if r.error is None and r.ttft is not None]
    e0, e1 = _engine(before), _engine(after)

    def delta(key: str) -> int:
        return int(e1.get(key, 0) - e0.get(key, 0))

    row = {
        "system": system,
        "rate": rate,
        **{k: round(v, 3) for k, v in win.items()},
        "num_requests": len(results),
        "num_errors": sum(r.error is not None for r in results),
        "errors": sorted({r.error for r in results if r.error is not None})[:3],
        "latency_p50_s": percentile(lat, 50),
        "latency_p90_s": percentile(lat, 90),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "p90_by_workflow": {
            m: percentile(
                [
                    r.latency if r.error is None else float("inf")
                    for r in measured
                    if r.workflow == m
                ],
                90,
            )
            for m in models
        },  # fmt: skip
        "kv_hit_tokens": delta("prefix_cache_hit_tokens"),
        "kv_query_tokens": delta("prefix_cache_query_tokens"),
        "fused_tokens": delta("num_fused_tokens"),
        "recomputed_tokens": delta("num_recomputed_tokens"),
        "preemptions": delta("preemptions"),
        "tier_hit_rate": (after.get("tier") or {}).get("hit_rate"),
        "tier_scans": _scans(before, after),
        "cosched": after["stats"].get("cosched"),
        **util.summary(start + args.warmup, start + times[-1]),
    }
    row["sustained"] = is_sustained(row)
    for key in ("latency_p50_s", "latency_p90_s", "latency_p99_s"):  # JSON has no inf
        if row[key] is not None and not np.isfinite(row[key]):
            row[key] = None
    row["p90_by_workflow"] = {
        k: (v if v is not None and np.isfinite(v) else None)
        for k, v in row["p90_by_workflow"].items()
    }
    logger.info("%s", json.dumps({k: v for k, v in row.items() if k != "p90_by_workflow"}))
    return row


def p90_or_inf(row: dict) -> float:
    return float("inf") if row["latency_p90_s"] is None else row["latency_p90_s"]


# -- the run -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Search:
    """``SYSTEM=find:LO,HI,N``: the sustained rate searched (``sustained.find_capacity``: LO,
    then HI, widened by HI/LO either way until bracketed, then geometric bisection) in at most
    N points, for a card whose capacity is not known in advance."""

    lo: float
    hi: float
    points: int


def parse_rates(specs: list[str]) -> dict[str, list[float] | Search]:
    """``SYSTEM=r1,r2`` (``ablations=...`` for every ablation; ``auto``: ragserve's capacity
    and the next rate above it, ``--ablation-points`` of them; ``find:LO,HI,N``: a Search)."""
    out: dict[str, list[float] | Search] = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        names = ABLATIONS if name == "ablations" else (name,)
        for n in names:
            if n not in SYSTEMS:
                raise ValueError(f"--rates {spec!r}: unknown system {n!r}; know {list(SYSTEMS)}")
            find = values.startswith("find:")
            rates = (
                []
                if values == "auto"
                else [float(v) for v in values.removeprefix("find:").split(",")]
            )
            if any(r <= 0 for r in rates):
                raise ValueError(f"--rates {spec!r}: rates must be > 0")
            if find and (len(rates) != 3 or not rates[0] < rates[1] or rates[2] < 2):
                raise ValueError(f"--rates {spec!r}: find:LO,HI,N needs LO < HI and N >= 2")
            out[n] = Search(rates[0], rates[1], int(rates[2])) if find else sorted(rates)
    return out


def ablation_rates(rows: list[dict], points: int) -> list[float]:
    """ragserve's highest sustained rate, then the lowest unsustained one above it."""
    own = [r for r in rows if r["system"] == "ragserve"]
    good = [r["rate"] for r in own if r["sustained"]]
    bad = [r["rate"] for r in own if not r["sustained"] and (not good or r["rate"] > max(good))]
    rates = ([max(good)] if good else []) + ([min(bad)] if bad else [])
    if not own:
        return []
    return rates[:points] or [min(r["rate"] for r in own)]


def run(args) -> int:
    p = PRESETS[args.preset]
    rates = parse_rates(args.rates)
    order = [s for s in args.systems if s in rates]
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    data = prepare(p, "synthetic", args.out / "data", nprobe=args.nprobe)
    data["nlist"] = p.nlist
    _free_cuda_cache()  # the index build's GPU memory, cached by torch in this process
    data["engine_kwargs"] = {**data["engine_kwargs"], **json.loads(args.engine_json)}
    prepare_s = time.monotonic() - t_start
    config = write_config(args.out / "serve.toml", data, in_process=args.in_process)
    cmd = server_command(config, args.port or free_port(), args)
    meta = {
        "argv": sys.argv, "preset": args.preset, "seed": args.seed, "slo_s": args.slo,
        "warmup_s": args.warmup, "window_s": args.window, "drain_s": args.drain,
        "nprobe": data["nprobe"], "nlist": p.nlist, "num_docs": p.num_docs, "dim": p.dim,
        "max_tokens": p.max_tokens, "topk": p.topk, "tier_gb": args.tier_gb,
        "engine": data["engine_kwargs"], "server_cmd": cmd, "commit": args.commit,
        "host": platform.node(), "cpus": os.cpu_count(), "prepare_s": round(prepare_s, 1),
        "not_run": [],
    }  # fmt: skip
    path = args.out / "results.json"
    rows: list[dict] = []

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        tmp.replace(path)

    def search(system: str, spec: Search, point: Callable[[float], dict]) -> None:
        def probe(rate: float) -> dict:
            if time.monotonic() - t_start + point_s > args.budget:
                raise TimeoutError(rate)
            rows.append(point(rate))
            save()
            return rows[-1]

        try:
            cap = find_capacity(probe, spec.lo, spec.hi, max_points=spec.points, expand=True)
            meta.setdefault("capacity", {})[system] = [cap.rate, cap.bound, cap.upper]
        except TimeoutError as e:
            meta["not_run"].append({"system": system, "rate": e.args[0], "why": "budget"})
        save()

    if args.server_mode == "process":
        server = ServedProcess(cmd, args.out / "server.log", args.preset, args.start_timeout)
    else:
        server = InThreadServer(cmd, args.preset)
    meta["server_start_s"] = round(server.start_s, 1)
    save()
    tier_state = [args.tier_gb > 0]
    point_s = args.warmup + args.window + args.point_overhead
    try:
        for system in order:
            if isinstance(rates[system], Search):
                point = functools.partial(measure, server, system, data=data, args=args,
                                          tier_state=tier_state)  # fmt: skip
                search(system, rates[system], point)
                continue
            todo = rates[system] or ablation_rates(rows, args.ablation_points)
            low = None
            for rate in todo:
                if time.monotonic() - t_start + point_s > args.budget:
                    meta["not_run"].append({"system": system, "rate": rate, "why": "budget"})
                    save()
                    continue
                row = measure(server, system, rate, data, args, tier_state)
                rows.append(row)
                save()
                low = p90_or_inf(row) if low is None else low
                if p90_or_inf(row) > args.stop_factor * low:
                    rest = todo[todo.index(rate) + 1 :]
                    meta["not_run"] += [{"system": system, "rate": r, "why": "p90 > 5x"}
                                        for r in rest]  # fmt: skip
                    break
    finally:
        meta["server_log_tail"] = server.tail(2000)
        server.stop()
        meta["wall_s"] = round(time.monotonic() - t_start, 1)
        save()
    if not args.no_plot:
        plot(rows, args.out / "served_capacity.png", args.slo)
    print(report(json.loads(path.read_text())))
    return 0


# -- report ------------------------------------------------------------------------------
def capacity(rows: list[dict], system: str) -> tuple[float | None, float | None]:
    """(highest sustained offered rate, lowest unsustained offered rate) of ``system``."""
    own = [r for r in rows if r["system"] == system]
    good = [r["offered_rps"] for r in own if r["sustained"]]
    bad = [r["offered_rps"] for r in own if not r["sustained"]]
    return (max(good) if good else None), (min(bad) if bad else None)


def rate_at_p90(rows: list[dict], system: str, p90: float) -> float | None:
    """The offered rate at which ``system``'s p90 reaches ``p90`` (linear between its points;
    ``None`` when its lowest point is already slower; its top rate when none reaches it)."""
    pts = sorted((r["offered_rps"], p90_or_inf(r)) for r in rows if r["system"] == system)
    if not pts or pts[0][1] > p90:
        return None
    for (r0, l0), (r1, l1) in zip(pts, pts[1:], strict=False):
        if l1 >= p90 >= l0:
            return r0 if not np.isfinite(l1) else r0 + (r1 - r0) * (p90 - l0) / max(l1 - l0, 1e-9)
    return pts[-1][0]


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(doc: dict) -> str:
    """Markdown: every point, then capacities and the issue's two ratios."""
    rows, meta = doc["rows"], doc["meta"]
    head = ("| system | rate | offered | completed | within SLO | p50 / p90 / p99 s "
            "| TTFT p50 / p90 s | KV hit tok/req | fused tok/req | tier hit | CPU % | GPU % "
            "| sustained |")  # fmt: skip
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        n = max(r["num_requests"], 1)
        lat = " / ".join(_fmt(r[k]) for k in ("latency_p50_s", "latency_p90_s", "latency_p99_s"))
        ttft = f"{_fmt(r['ttft_p50_s'])} / {_fmt(r['ttft_p90_s'])}"
        ok = "yes" if r["sustained"] else "no"
        lines.append(
            f"| {r['system']} | {r['rate']:g} | {r['offered_rps']:.2f} | {r['completed_rps']:.2f} "
            f"| {100 * r['window_slo_attainment']:.0f} % | {lat} | {ttft} "
            f"| {r['kv_hit_tokens'] / n:.1f} | {r['fused_tokens'] / n:.1f} "
            f"| {_fmt(r['tier_hit_rate'])} | {_fmt(r['cpu_util_pct'], 0)} "
            f"| {_fmt(r['gpu_util_pct'], 0)} | {ok} |"
        )
    lines += ["", "| system | sustained (offered req/s) | first unsustained |",
              "| --- | --- | --- |"]  # fmt: skip
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for s in systems:
        good, bad = capacity(rows, s)
        lines.append(f"| {s} | {_fmt(good)} | {_fmt(bad)} |")
    rs, llm, base = (capacity(rows, s)[0] for s in ("ragserve", "llm-alone", "baseline"))
    if rs and llm:
        lines.append(f"\nragserve / LLM alone (sustained): {rs / llm:.2f} (target >= 0.60)")
    if rs and base:
        base_row = max((r for r in rows if r["system"] == "baseline" and r["sustained"]),
                       key=lambda r: r["offered_rps"])  # fmt: skip
        at = rate_at_p90(rows, "ragserve", p90_or_inf(base_row))
        ratio = _fmt(at and at / base_row["offered_rps"])
        lines.append(f"ragserve / baseline (sustained): {rs / base:.2f}; at the baseline's p90 "
                     f"{p90_or_inf(base_row):.2f} s: {_fmt(at)} vs {base_row['offered_rps']:.2f} "
                     f"req/s = {ratio} (target >= 1.5)")  # fmt: skip
    if meta.get("not_run"):
        lines.append(f"not run: {json.dumps(meta['not_run'])}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, slo: float | None = None) -> None:
    """p50 (dashed) and p90 (solid) latency vs offered load, one colour per system; the SLO
    as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for system in dict.fromkeys(r["system"] for r in rows):
        own = sorted((r for r in rows if r["system"] == system), key=lambda r: r["offered_rps"])
        x = [r["offered_rps"] for r in own]
        style = {"marker": "o", "linewidth": 2} if system not in ABLATIONS else {"marker": "x"}
        (line,) = ax.plot(x, [p90_or_inf(r) for r in own], label=f"{system} p90", **style)
        ax.plot(x, [r["latency_p50_s"] or np.nan for r in own], "--", color=line.get_color(),
                alpha=0.6)  # fmt: skip
    if slo is not None:
        ax.axhline(slo, color="grey", linestyle=":", label=f"SLO {slo:g} s")
    ax.set_xlabel("offered load (req/s, mixed workflows)")
    ax.set_ylabel("end-to-end latency (s); solid p90, dashed p50")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--out", type=Path, default=Path("bench/results/served"))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS),
                    help="run order (the tier is dropped for no-tier: keep it last)")  # fmt: skip
    ap.add_argument("--rates", nargs="+", default=["ragserve=2,4", "llm-alone=2,4"],
                    metavar="SYSTEM=R1,R2",
                    help="rates per system; ablations=auto; SYSTEM=find:LO,HI,N")  # fmt: skip
    ap.add_argument("--ablation-points", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--drain", type=float, default=20.0,
                    help="cut requests unfinished this long after the last arrival")  # fmt: skip
    ap.add_argument("--slo", type=float, default=10.0)
    ap.add_argument("--stop-factor", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nprobe", type=int, default=None, help="default: the preset's")
    ap.add_argument("--tier-gb", type=float, default=0.0, help="--gpu-index-gb (0: no tier)")
    ap.add_argument("--tier-device", default="cuda", help="--gpu-index-device")
    ap.add_argument("--tier-scan", default="auto", help="--gpu-index-scan (auto: as shipped)")
    ap.add_argument("--max-inflight", type=int, default=1024, help="serve's admission bound")
    ap.add_argument("--engine-json", default="{}", help="extra [engine] keys, JSON")
    ap.add_argument("--in-process", action="store_true", help="[runtime] in_process (tests)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--server-mode", choices=("process", "thread"), default="process",
                    help="the server in its own process, or on a thread here (tests)")  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds from the start after which no new point begins")  # fmt: skip
    ap.add_argument("--point-overhead", type=float, default=15.0,
                    help="a point's seconds beyond warm-up + window (drain, switches)")  # fmt: skip
    ap.add_argument("--sample-s", type=float, default=1.0, help="CPU/GPU sampling period")
    ap.add_argument("--commit", default=None, help="the src commit measured (recorded)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--report", type=Path, default=None, help="print a results.json's tables")
    ap.add_argument("--plot", type=Path, default=None, help="with --report: draw its plot here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.report is not None:
        doc = json.loads(args.report.read_text())
        print(report(doc))
        if args.plot is not None:
            plot(doc["rows"], args.plot, doc["meta"].get("slo_s"))
        return 0
    parse_rates(args.rates)  # a bad spec fails before the index and the server
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
