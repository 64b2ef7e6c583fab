"""ragserve.server: the OpenAI-compatible HTTP front (``ragserve serve``).

``create_app(server, config)`` builds the ASGI app around a ``ragserve.runtime.Server``;
``serve`` runs it under uvicorn in the foreground, ``BackgroundServer`` on a thread.

The HTTP stack (fastapi, uvicorn) is imported on first use of those names, so commands that
only need ``ServeConfig`` (``ragserve profile-memory``, ``index``, the launch-config loader)
run where the ``serve`` extras are not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from ragserve.server.config import ServeConfig

_LAZY = {
    "create_app": "ragserve.server.app",
    "BackgroundServer": "ragserve.server.launch",
    "serve": "ragserve.server.launch",
}

__all__ = ["BackgroundServer", "ServeConfig", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ragserve.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
