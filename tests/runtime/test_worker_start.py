"""How workers start (``worker_start.py``): the fork server keeps the environment it started
with, yet every worker forked from it runs under the server's environment of its own start."""

from __future__ import annotations

import os

import pytest

from ragserve.runtime import ServerConfig
from ragserve.runtime.worker_start import worker_context, worker_process


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_sees_the_environment_of_its_start(tmp_path, monkeypatch, method) -> None:
    ctx = worker_context(method)
    for value in ("first", "second"):  # the fork server is up, with "first", for the second
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
