"""Run the app under uvicorn: in the foreground (``ragserve serve``) or in a background
thread (tests, benchmarks). Both shut down gracefully: the listening socket closes, in-flight
requests finish (up to ``drain_timeout_s``), then the app's shutdown closes what it owns."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from ragserve.server.backend import ServerBackend
from ragserve.server.config import ServeConfig
from ragserve.server.connections import header_timeout_protocol

logger = logging.getLogger(__name__)


def _uvicorn_server(app, config: ServeConfig) -> uvicorn.Server:
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=config.drain_timeout_s,
        lifespan="on",
        http=header_timeout_protocol(config.header_timeout_s),
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.max_connections,
    )
    return uvicorn.Server(uv_config)


def serve(server: ServerBackend, config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM, then drain and close ``server``. Blocks."""
    from ragserve.server.app import create_app

    app = create_app(server, config, own_server=True)
    logger.info("ragserve HTTP front on http://%s:%d", config.host, config.port)
    _uvicorn_server(app, config).run()


class BackgroundServer:
    """uvicorn serving ``app`` on a thread; ``port=0`` picks a free port (see ``.port``).

    >>> with BackgroundServer(app, ServeConfig(port=0)) as bg:
    ...     httpx.get(f"{bg.url}/health")
    """

    def __init__(self, app, config: ServeConfig, *, start_timeout_s: float = 30.0) -> None:
        self._server = _uvicorn_server(app, config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._start_timeout_s = start_timeout_s
        self.host = config.host

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn failed to start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown: stop accepting, drain in-flight requests, run app shutdown."""
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
