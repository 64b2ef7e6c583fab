"""Catch the missing ``if __name__ == "__main__":`` guard before worker processes start: the
forkserver and spawn methods re-import ``__main__`` in every child, so a ``Server`` created
at module level would start again in each one, which dies with only an exit code."""

from __future__ import annotations

import ast
import multiprocessing
import sys
from functools import lru_cache
from types import FrameType

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
        if multiprocessing.parent_process() is not None:
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
