"""ragserve.server: the OpenAI-compatible HTTP front (``ragserve serve``). The HTTP stack is
imported on first use of ``create_app`` / ``serve`` / ``BackgroundServer``, so what needs only
``ServeConfig`` runs without the ``serve`` extras."""

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
