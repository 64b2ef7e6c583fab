"""The real stacks the HTTP tests drive: ``ragserve serve`` as a process on a tiny model and
an 8-document index (``make_assets``, ``serve_process``), and an in-process ``Server`` over
capitals and rivers (``FACTS``, ``tiny_server``, one per session: ``conftest.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def make_assets(root: Path) -> tuple[str, str]:
    """``(model folder, index folder)``: a tiny random llama and 8 facts about the river Ix."""
    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from testing import make_tiny_model

    model = make_tiny_model(root / "tiny", "llama", seed=0)
    docs = [
        Document(f"d{i}", f"Fact number {i} about the river Ix.", f"Fact {i}") for i in range(8)
    ]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=2)
    index.save(root / "index")
    index.close()
    return str(model), str(root / "index")


FACTS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
]


@contextlib.contextmanager
def tiny_server(root: Path):
    """A ``Server`` (in process, CPU) over a tiny seeded llama and a 12-document index."""
    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from ragserve.runtime import Server, ServerConfig
    from testing import make_tiny_model

    model = make_tiny_model(root / "tiny-llama", "llama", seed=0)
    docs = [Document(f"{c}-cap", f"The capital of {c} is {cap}.", c) for c, cap in FACTS]
    docs += [Document(f"{c}-geo", f"{c} is a country with many rivers.", c) for c, _ in FACTS]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=2)
    index.save(root / "index")
    index.close()
    config = ServerConfig(in_process=True, engine_kwargs={"device": "cpu"})
    with Server(str(model), str(root / "index"), config=config) as server:
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
    new_session: bool = False,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``ragserve serve ARGV --port P`` until ``/health`` answers; killed at exit if alive.
    ``new_session``: in its own process group (a terminal's, for ``os.killpg``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ragserve.cli.main", "serve", *argv, "--port", str(port)]
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe blocks
        proc = subprocess.Popen(
            cmd, env=env or dict(os.environ), stdout=log, stderr=log, start_new_session=new_session
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                assert proc.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, "ragserve serve did not come up"
                time.sleep(0.2)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if new_session:  # its workers too, should any outlive it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
