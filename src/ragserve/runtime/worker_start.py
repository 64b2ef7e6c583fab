"""How worker processes start: forked from a fork server that has already imported torch,
Faiss, transformers and ragserve (``worker_preload.py``: a restart then skips most of its
outage, docs/reliability.md), or spawned afresh. Each worker gets the server's environment of
the moment it is started, as a spawned one would.

Both methods re-import ``__main__`` in every child, so a ``Server`` created at module level
would start again in each one, which dies with only an exit code: ``check_main_guard`` catches
the missing ``if __name__ == "__main__":`` guard before any worker starts."""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from functools import lru_cache
from multiprocessing.context import BaseContext
from types import FrameType
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


GUARD_HELP = (
    "a Server with worker processes was created while the script's __main__ module is still "
    'being imported, outside `if __name__ == "__main__":`; worker processes re-import the '
    "script, so put the code that creates the Server under that guard (see the README), or "
    "pass ServerConfig(in_process=True)"
)


MAIN_TESTS = ("__name__ == '__main__'", "'__main__' == __name__")  # as ``ast.unparse`` writes


class MainGuardError(RuntimeError):
    """Raised by ``Server(...)`` created at import time of an unguarded ``__main__``."""


def check_main_guard() -> None:
    """Raise ``MainGuardError`` if this call comes from module-level code of ``__main__``
    outside the ``__main__`` guard (or from a spawned child re-importing the script)."""
    frame = _main_module_frame(("__main__", "__mp_main__"))
    if frame is None:
        return
    if frame.f_globals.get("__name__") == "__mp_main__":
        if mp.parent_process() is not None:
            raise MainGuardError(GUARD_HELP)
        return
    filename = frame.f_globals.get("__file__")
    # NOTE: no file (a REPL, a notebook, `python -c`): spawn does not re-import such a main.
    if filename and not _is_guarded(filename, frame.f_lineno):
        raise MainGuardError(f"{GUARD_HELP} ({filename}:{frame.f_lineno})")


def _main_module_frame(names: tuple[str, ...]) -> FrameType | None:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") in names:
            return frame
        frame = frame.f_back
    return None


def _is_guarded(filename: str, lineno: int) -> bool:
    return any(a <= lineno <= b for a, b in _guard_ranges(filename))


@lru_cache(maxsize=8)
def _guard_ranges(filename: str) -> tuple[tuple[int, int], ...]:
    """The top-level ``__main__`` blocks of ``filename`` (an unreadable file: all guarded)."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return ((1, sys.maxsize),)
    return tuple(
        (node.lineno, node.end_lineno or node.lineno)
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) in MAIN_TESTS
    )
