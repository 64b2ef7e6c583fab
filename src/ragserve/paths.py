"""Where ragserve keeps converted models, built indexes and other caches."""

from __future__ import annotations

import os
from pathlib import Path


def ragserve_home() -> Path:
    """``$RAGSERVE_HOME`` if set, else ``~/.cache/ragserve``; created on first use."""
    root = Path(os.environ.get("RAGSERVE_HOME") or Path.home() / ".cache" / "ragserve")
    root.mkdir(parents=True, exist_ok=True)
    return root
