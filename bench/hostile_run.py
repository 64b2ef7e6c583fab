"""Hostile-input run for docs/reliability.md (issue 11): a real ``Server`` (both workers as
processes; tiny seeded model, small real index) behind uvicorn on loopback.

1. Fuzz: ``--num-fuzz`` requests drawn (seeded) from the poison corpus of
   tests/server/hostile_cases.py and random mutations of valid bodies, sent 8 at a time,
   with an innocent chat request after every third one and a completion whose engine step
   raises (an injected fault, ``generation/faults.py``) after every thirtieth. Counts 5xx
   among the fuzzed requests, hangs (no answer within ``--hang-s``), worker crashes
   (restarts), innocent requests that failed.
2. Kill cycles: upserts run continuously while the retrieval worker is killed with SIGKILL
   ``--kill-cycles`` times; every acknowledged (200) upsert must be present afterwards
   (checked by deleting it: 200, not 404). Recovery time = kill -> first 200 upsert.
3. Generation kill cycles (``--gen-kill-cycles``): chats run continuously while the
   generation worker is killed with SIGKILL; recovery = kill -> first 200 chat sent after it.

``--worker-start-method spawn`` measures the workers started without the fork server.

    PYTHONPATH=src python bench/hostile_run.py --out bench/results/hostile_run.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "server")]  # hostile_cases; testing (tiny models)
from hostile_cases import CHAT, CMPL, DOCS, POISON, chat, cmpl  # noqa: E402

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima")]
ODD = [None, True, -1, 0, 2**64, 1e-45, 5e-324, 1e308, "10", "", "\u0000", [], {}, [[[]]]]
# NOTE: completions with this stop string raise inside the engine's forward pass
# ($RAGSERVE_FAULT_INJECT, set below before the workers start): step isolation must fail them
# alone (500 internal_error) while the innocent chats in the same steps finish.
STEP_POISON = "<ragserve-step-poison>"
FIELDS = {
    CHAT: ["messages", "max_tokens", "temperature", "top_p", "seed", "stop", "topk", "nprobe"],
    CMPL: ["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "top_k", "stream"],
    DOCS: ["documents"],
}


def mutated(rng: random.Random) -> tuple[str, object]:
    if rng.random() < 0.5:
        path, body, _ = rng.choice(POISON)
        return path, body
    path = rng.choice(sorted(FIELDS))
    base = {CHAT: chat(), CMPL: cmpl(), DOCS: {"documents": [{"id": "f", "text": "t"}]}}[path]
    for field in rng.sample(FIELDS[path], rng.randint(1, min(3, len(FIELDS[path])))):
        base[field] = rng.choice(ODD)
    return path, base


def send(client: httpx.Client, path: str, body) -> int | None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    try:
        r = client.post(path, headers={"content-type": "application/json"}, **kwargs)
    except httpx.TimeoutException:
        return None
    return r.status_code


def restarts(server) -> int:
    return sum(w["restarts"] for w in server.stats()["workers"].values())


def fuzz(url: str, server, num: int, hang_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    cases = [mutated(rng) for _ in range(num)]
    before = restarts(server)
    with httpx.Client(base_url=url, timeout=hang_s) as client, ThreadPoolExecutor(8) as pool:
        fuzzed = [pool.submit(send, client, p, b) for p, b in cases]
        innocent = [
            pool.submit(send, client, CHAT, chat(messages=[{"role": "user", "content": f"Q{i}"}]))
            for i in range(num // 3)
        ]
        poisoned = [
            pool.submit(send, client, CMPL, cmpl(prompt=f"P{i}", stop=[STEP_POISON]))
            for i in range(num // 30)
        ]
        codes = [f.result() for f in fuzzed]
        good = [f.result() for f in innocent]
        steps = [f.result() for f in poisoned]
    return {
        "requests_fuzzed": num,
        "status_counts": {str(c): codes.count(c) for c in sorted(set(codes), key=str)},
        "responses_5xx": sum(1 for c in codes if c is not None and c >= 500),
        "hangs": codes.count(None) + good.count(None),
        "hung_requests": [
            f"{p} {str(b)[:300]}" for (p, b), c in zip(cases, codes, strict=True) if c is None
        ],
        "worker_crashes": restarts(server) - before,
        "step_poison_requests": len(steps),
        "step_poison_status_counts": {str(c): steps.count(c) for c in sorted(set(steps), key=str)},
        "innocent_requests": len(good),
        "innocent_failed": sum(1 for c in good if c != 200),
    }


def kill_cycles(url: str, server, cycles: int) -> dict | None:
    if cycles < 1:
        return None
    acked: list[str] = []
    stop = threading.Event()
    counter = iter(range(10**9))
    last_ok = [time.monotonic()]

    def upserter() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                ids = [f"k{next(counter)}" for _ in range(4)]
                docs = [{"id": i, "text": f"Passage {i} about Lima."} for i in ids]
                r = client.post(DOCS, json={"documents": docs})
                if r.status_code == 200:
                    acked.extend(ids)
                    last_ok[0] = time.monotonic()
                elif r.status_code not in (503, 429):
                    raise RuntimeError(f"unexpected upsert status {r.status_code}: {r.text}")

    thread = threading.Thread(target=upserter, daemon=True)
    thread.start()
    recoveries = []
    for _ in range(cycles):
        time.sleep(1.0)
        worker = server.executor.workers["ret"]
        killed = time.monotonic()
        os.kill(worker.proc.pid, signal.SIGKILL)
        while last_ok[0] <= killed:
            time.sleep(0.05)
        recoveries.append(last_ok[0] - killed)
    stop.set()
    thread.join(120)
    with httpx.Client(base_url=url, timeout=60) as client:
        missing = [
            i for i in acked if client.delete(f"/v1/documents/{quote(i)}").status_code != 200
        ]
    return {
        "kill_cycles": cycles,
        "upserts_acknowledged": len(acked),
        "upserts_lost": len(missing),
        "recovery_s": {
            "median": sorted(recoveries)[len(recoveries) // 2],
            "max": max(recoveries),
        },
    }


def gen_kill_cycles(url: str, server, cycles: int) -> dict | None:
    """Chats run continuously while the generation worker is killed ``cycles`` times;
    recovery = kill -> the first 200 chat sent after the kill."""
    if cycles < 1:
        return None
    stop = threading.Event()
    oks: list[tuple[float, float]] = []  # (sent, answered) of each 200 chat
    hangs = []  # chats not answered within 120 s

    def chatter() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = client.post(CHAT, json=chat(messages=[{"role": "user", "content": "Hi"}]))
                except httpx.TimeoutException:
                    hangs.append(sent)
                    continue
                if r.status_code == 200:
                    oks.append((sent, time.monotonic()))
                elif r.status_code not in (503, 429):
                    raise RuntimeError(f"unexpected chat status {r.status_code}: {r.text}")

    thread = threading.Thread(target=chatter, daemon=True)
    thread.start()
    recoveries = []
    for _ in range(cycles):
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(server.executor.workers["gen"].proc.pid, signal.SIGKILL)
        while not any(sent > killed for sent, _ in oks):
            time.sleep(0.05)
        recoveries.append(min(done for sent, done in oks if sent > killed) - killed)
    stop.set()
    thread.join(120)
    return {
        "kill_cycles": cycles,
        "chat_hangs": len(hangs),
        "recovery_s": {"median": sorted(recoveries)[len(recoveries) // 2], "max": max(recoveries)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--num-fuzz", type=int, default=600)
    ap.add_argument("--kill-cycles", type=int, default=10)
    ap.add_argument("--gen-kill-cycles", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker-start-method", default="forkserver", choices=["forkserver", "spawn"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from ragserve.runtime import Server, ServerConfig
    from ragserve.server import BackgroundServer, ServeConfig, create_app
    from testing import make_tiny_model

    os.environ["RAGSERVE_FAULT_INJECT"] = f"forward:{STEP_POISON}"
    root = Path(tempfile.mkdtemp(prefix="hostile-"))
    os.environ.setdefault("RAGSERVE_HOME", str(root / "home"))
    model = make_tiny_model(root / "tiny-llama", "llama", seed=0)
    docs = [Document(f"{c}-cap", f"The capital of {c} is {k}.", c) for c, k in CAPITALS]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=2)
    index.save(root / "index")
    index.close()
    config = ServerConfig(
        engine_kwargs={"device": "cpu"}, worker_start_method=args.worker_start_method
    )
    serve = ServeConfig(port=0, served_model_name="tiny", max_num_inflight=64)
    with (
        Server(str(model), str(root / "index"), config=config) as server,
        BackgroundServer(create_app(server, serve), serve) as bg,
    ):
        result = {"fuzz": fuzz(bg.url, server, args.num_fuzz, args.hang_s, args.seed)}
        result["kill"] = kill_cycles(bg.url, server, args.kill_cycles)
        result["gen_kill"] = gen_kill_cycles(bg.url, server, args.gen_kill_cycles)
        result["worker_start_method"] = args.worker_start_method
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
