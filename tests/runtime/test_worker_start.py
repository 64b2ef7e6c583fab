"""How workers start (``worker_start.py``): the fork server keeps the environment it started
with, yet every worker forked from it runs under the server's environment of its own start."""

from __future__ import annotations

import os

import pytest

from ragserve.runtime import ServerConfig
from ragserve.runtime.worker_start import start_fork_server, worker_context, worker_process


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_sees_the_environment_of_its_start(tmp_path, monkeypatch, method) -> None:
    ctx = worker_context(method)
    # the fork server is up, with "first", for the second; a spawned worker is fresh each time
    for value in ("first", "second") if method == "forkserver" else ("second",):
        monkeypatch.setenv("RAGSERVE_TEST_MARK", value)
        out = tmp_path / f"{method}-{value}.txt"
        proc = worker_process(ctx, os.system, (f'printf %s "$RAGSERVE_TEST_MARK" > {out}',), "p")
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0 and out.read_text() == value


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="worker_start_method"):
        ServerConfig(worker_start_method="fork")
    with pytest.raises(ValueError, match="worker_start_method"):
        worker_context("fork")


def test_workers_fork_from_the_fork_server_started_ahead(tmp_path) -> None:
    pid = start_fork_server("forkserver")
    assert pid is not None and pid != os.getpid() and start_fork_server("forkserver") == pid
    assert start_fork_server("spawn") is None
    out = tmp_path / "ppid.txt"
    # the shell's parent ($PPID) is the worker; the worker's parent must be the fork server
    cmd = f"cut -d')' -f2 /proc/$PPID/stat | awk '{{print $2}}' > {out}"
    proc = worker_process(worker_context("forkserver"), os.system, (cmd,), "p")
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0 and int(out.read_text()) == pid
