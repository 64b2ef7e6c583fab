"""How worker processes start: forked from a fork server that has already imported torch,
Faiss, transformers and ragserve (``worker_preload.py``: a restart then skips most of its
outage, docs/reliability.md), or spawned afresh. Each worker gets the server's environment of
the moment it is started, as a spawned one would."""

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
    ``"spawn"``); it imports ``PRELOAD`` in the background while the caller goes on."""
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
