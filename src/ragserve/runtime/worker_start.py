"""How worker processes start: forked from a fork server that has already imported torch,
Faiss, transformers and ragserve (``worker_preload.py``), or spawned afresh.

A spawned worker spends most of its start importing those libraries (about 20 s of a 28 s
restart on this 2-core machine at load average ~7, docs/reliability.md), and that start is
the whole outage of a worker kill. With
``"forkserver"`` that import happens once, in the fork server, and every start and restart
forks from it. The fork server keeps the environment it started with, so each worker gets the
server's environment of the moment it is started (as a spawned one would) before it runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

START_METHODS = ("forkserver", "spawn")
PRELOAD = "ragserve.runtime.worker_preload"


def worker_context(method: str) -> BaseContext:
    """The ``multiprocessing`` context for ``method`` (``START_METHODS``); for
    ``"forkserver"`` the fork server preloads ``PRELOAD`` when it first starts."""
    if method not in START_METHODS:
        raise ValueError(f"worker_start_method must be one of {START_METHODS}, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([PRELOAD])
    return ctx


def start_fork_server(method: str) -> int | None:
    """Launch the fork server now, if ``method`` uses one, and return its pid (``None`` for
    ``"spawn"``). It imports ``PRELOAD`` in the background while the caller goes on (index and
    memory plan resolution); the first worker start then waits only for what is left."""
    worker_context(method)
    if method != "forkserver":
        return None
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid  # noqa: SLF001 (stdlib's only handle)


def worker_process(ctx: BaseContext, target: Callable[..., None], args: tuple, name: str) -> Any:
    """A daemon process (not started) running ``target(*args)`` under this process's current
    environment."""
    return ctx.Process(
        target=run_with_environ, args=(dict(os.environ), target, *args), name=name, daemon=True
    )


def run_with_environ(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """In the worker: take the parent's environment, then run ``target(*args)``."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
