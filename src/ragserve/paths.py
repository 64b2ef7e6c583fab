"""Where ragserve keeps converted models, built indexes and other caches."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def ragserve_home() -> Path:
    """``$RAGSERVE_HOME`` if set, else ``~/.cache/ragserve``; created on first use."""
    root = Path(os.environ.get("RAGSERVE_HOME") or Path.home() / ".cache" / "ragserve")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder) for the block.

    Serialises first-use work in the cache (one conversion or index build at a time, across
    processes).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
