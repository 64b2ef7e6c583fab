"""Issue 11's five findings as regression tests against the real stack: the ``Server`` with
its two worker processes (tiny seeded model, small real index) behind real uvicorn on
loopback. Each poison request is sent while innocent requests run; the poison gets a 4xx,
every innocent request succeeds, and no worker restarts."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hostile_cases import CHAT, CMPL, DOCS, POISON, chat, nested

from ragserve.generation.faults import FAULT_ENV
from ragserve.server import BackgroundServer, ServeConfig, create_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEADER_TIMEOUT = 1.0
STEP_POISON = "<step-poison>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from ragserve.runtime import Server, ServerConfig
    from testing import make_tiny_model

    root = tmp_path_factory.mktemp("hostile")
    model = make_tiny_model(root / "tiny-llama", "llama", seed=0)
    docs = [Document(f"{c}-cap", f"The capital of {c} is {k}.", c) for c, k in CAPITALS]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=2)
    index.save(root / "index")
    index.close()
    config = ServerConfig(engine_kwargs={"device": "cpu"}, call_timeout_s=60.0)
    # NOTE: the generation worker's forward pass raises for requests with this stop string
    # (``generation/faults.py``); the worker takes the environment of its start.
    before = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = f"forward:{STEP_POISON}"
    try:
        with Server(str(model), str(root / "index"), config=config) as s:
            yield s
    finally:
        if before is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = before


CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima")]


@pytest.fixture(scope="module")
def bg(server):
    config = ServeConfig(port=0, served_model_name="tiny", header_timeout_s=HEADER_TIMEOUT)
    with BackgroundServer(create_app(server, config), config) as running:
        yield running


def post(url: str, path: str, body, timeout: float = 120) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{path}", headers=headers, timeout=timeout, **kwargs)


def restarts(server) -> dict[str, int]:
    return {k: v["restarts"] for k, v in server.stats()["workers"].items()}


def innocent(url: str, i: int) -> int:
    body = chat(messages=[{"role": "user", "content": f"What is the capital of Peru? ({i})"}])
    return post(url, CHAT, body).status_code


def test_poison_alongside_innocents_fails_alone(bg, server) -> None:
    """Findings 1-4: every poison body is a 400, innocents sent at the same time all 200."""
    before = restarts(server)
    with ThreadPoolExecutor(8) as pool:
        innocents = [pool.submit(innocent, bg.url, i) for i in range(8)]
        poison = [pool.submit(post, bg.url, path, body) for path, body, _ in POISON]
        statuses = [f.result().status_code for f in poison]
        assert [f.result() for f in innocents] == [200] * 8
    assert statuses == [400] * len(POISON)
    assert restarts(server) == before
    assert httpx.get(f"{bg.url}/health").status_code == 200


def test_a_request_whose_engine_step_raises_fails_alone(bg, server) -> None:
    """A completion whose forward pass raises inside the generation worker (an injected
    fault) is a 500 without the exception's text; innocent chats and completions in the same
    engine steps all get 200 and the worker does not restart."""
    before = restarts(server)
    poison = {"model": "tiny", "prompt": "Tell me", "max_tokens": 8, "stop": [STEP_POISON]}
    with ThreadPoolExecutor(8) as pool:
        innocents = [pool.submit(innocent, bg.url, i) for i in range(6)]
        bad = [pool.submit(post, bg.url, CMPL, poison) for _ in range(3)]
        plain = {"model": "tiny", "prompt": "The capital of", "max_tokens": 8}
        others = [pool.submit(post, bg.url, CMPL, plain) for _ in range(3)]
        assert [f.result() for f in innocents] == [200] * 6
        assert [f.result().status_code for f in others] == [200] * 3
        for f in bad:
            r = f.result()
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert "InjectedFault" not in r.text
    assert restarts(server) == before


def test_lone_surrogate_past_the_edge_fails_alone_in_the_worker(server) -> None:
    """Finding 3 behind the edge: the Python API hands the question to the retrieval worker
    as is; its batch is retried without it, so only it fails."""
    import asyncio

    async def together():
        bad = server.submit("What \ud800 is Python?", "oneshot")
        good = [server.submit(f"What is the capital of Kenya? {i}", "oneshot") for i in range(6)]
        return await asyncio.gather(bad, *good)

    before = restarts(server)
    bad, *good = asyncio.run(asyncio.wait_for(together(), 300))
    assert bad.error is not None and bad.error_kind == "bad_request"
    assert [r.error for r in good] == [None] * 6
    assert restarts(server) == before


def test_unpicklable_upsert_is_an_error_not_a_hang(server) -> None:
    """Finding 2 behind the edge: a message that cannot be pickled fails in the caller."""
    from ragserve.retrieval import Document
    from ragserve.runtime import WorkerError

    doc = Document("deep", "A passage.", None, nested(5000))
    start = time.monotonic()
    with pytest.raises(ValueError, match="metadata"):
        server.add_documents([doc])  # the limits catch it first
    future = server.executor.call_retrieval("add_documents", [doc])  # past the limits
    with pytest.raises(WorkerError) as err:
        future.result(timeout=30)
    assert err.value.kind == "bad_request" and time.monotonic() - start < 30


def test_python_api_rejects_bad_sampling_and_documents() -> None:
    from ragserve.generation import SamplingParams
    from ragserve.retrieval import Document
    from ragserve.retrieval.limits import check_document

    for kwargs, field in [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e-45}, "temperature"),
        ({"top_p": 5e-324}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="text"):
        check_document(Document("big", "x" * 1_000_000))


def test_slowloris_is_cut_and_others_are_served(bg) -> None:
    """Finding 5."""
    socks = [socket.create_connection((bg.host, bg.port)) for _ in range(20)]
    for s in socks[10:]:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    try:
        assert innocent(bg.url, 0) == 200
        for s in socks:
            s.settimeout(HEADER_TIMEOUT + 10)
            while s.recv(4096):
                pass  # the server closes it (408 for the partial ones)
    finally:
        for s in socks:
            s.close()


def test_retrieval_worker_death_is_503_then_recovers(bg, server) -> None:
    """A killed retrieval worker costs an upsert in flight a 503 ``worker_died`` (not 500);
    /health is 503 until the worker is back, then everything works again."""
    worker = server.executor.workers["ret"]
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.join(10)
    body = {"documents": [{"id": "after-kill", "text": "The capital of Chile is Santiago."}]}
    statuses = set()
    deadline = time.monotonic() + 120
    while True:
        r = post(bg.url, DOCS, body)
        statuses.add(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died", r.text
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert statuses <= {200, 503}
    deadline = time.monotonic() + 60
    while httpx.get(f"{bg.url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert innocent(bg.url, 1) == 200
    r = post(bg.url, CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_a_stuck_retrieval_worker_is_a_timeout_not_a_hang(bg, server) -> None:
    """A retrieval worker that stops answering (SIGSTOP) costs a document call a 503
    ``worker_timeout`` after ``call_timeout_s`` and ``Server.embed`` a ``WorkerError``; once it
    runs again, calls succeed."""
    from ragserve.runtime.errors import WorkerError

    pid = server.executor.workers["ret"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        body = {"documents": [{"id": "stuck", "text": "The capital of Chile is Santiago."}]}
        r = post(bg.url, DOCS, body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_timeout", r.text
        with pytest.raises(WorkerError) as info:
            server.embed(["a text"])
        assert info.value.kind == "timeout"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert post(bg.url, DOCS, body).status_code == 200
    assert server.embed(["a text"]).vectors.shape[0] == 1


def test_generation_worker_death_is_503_then_recovers(bg, server) -> None:
    """A killed generation worker costs the requests it held a 503 ``worker_died``; it is
    restarted and the next requests are served."""
    worker = server.executor.workers["gen"]
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.join(10)
    body = {"model": "tiny", "prompt": "The capital of", "max_tokens": 4}
    deadline = time.monotonic() + 120
    while (r := post(bg.url, CMPL, body)).status_code != 200:
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died", r.text
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert innocent(bg.url, 2) == 200


KILL_SCRIPT = """
import os, signal, sys, time
from ragserve.runtime import Server, ServerConfig

if __name__ == "__main__":
    config = ServerConfig(engine_kwargs={"device": "cpu"})
    with Server(sys.argv[1], sys.argv[2], config=config) as server:
        for name in ("ret", "gen", "ret"):
            proc = server.executor.workers[name].proc
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            while server.health()["status"] != "ok":
                time.sleep(0.1)
        assert sum(w["restarts"] for w in server.stats()["workers"].values()) == 3
    print("closed")
"""


def test_worker_restarts_leak_no_semaphores(tmp_path, server) -> None:
    """Three SIGKILLed workers, restarted, then a clean exit: the resource tracker reports no
    leaked semaphore (tqdm's process-shared lock, fork server included)."""
    import subprocess
    import sys

    script = tmp_path / "kill_workers.py"
    script.write_text(KILL_SCRIPT)
    spec = server.executor.workers["gen"].spec, server.executor.workers["ret"].spec
    run = subprocess.run(
        [sys.executable, str(script), spec[0].model, spec[1].index],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if k != FAULT_ENV},
    )
    assert run.returncode == 0 and "closed" in run.stdout, run.stderr[-3000:]
    assert "leaked semaphore" not in run.stderr, run.stderr[-3000:]
