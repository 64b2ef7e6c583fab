"""ragserve.server: the OpenAI-compatible HTTP front (``ragserve serve``).

``create_app(server, config)`` builds the ASGI app around a ``ragserve.runtime.Server``;
``serve`` runs it under uvicorn in the foreground, ``BackgroundServer`` on a thread.
"""

from ragserve.server.app import create_app
from ragserve.server.config import ServeConfig
from ragserve.server.launch import BackgroundServer, serve

__all__ = ["BackgroundServer", "ServeConfig", "create_app", "serve"]
