"""Run the app under uvicorn, in the foreground (``ragserve serve``) or on a thread (tests,
benchmarks). Both shut down gracefully: the listening socket closes, in-flight requests finish
(up to ``drain_timeout_s``), then the app's shutdown closes what it owns."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ragserve.server.config import ServeConfig
from ragserve.server.context import ServerBackend
from ragserve.server.errors import error_bytes

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    """``H11Protocol`` with a deadline for request headers, which uvicorn lacks (a client that
    sends nothing, or a few bytes of headers, would hold its connection forever).

    The timer is armed whenever the connection waits for a request's headers (a new one, or
    the next request on a kept-alive one once its first byte arrives); on expiry it closes the
    connection (408 when some bytes came).
    """

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_timeout)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
            body = error_bytes(408, "request headers not received in time", "request_timeout")
            head = "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            head += f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
            self.transport.write(head.encode() + body)
        logger.debug("closing a connection whose request headers did not arrive in time")
        self.transport.close()


def _uvicorn_server(app, config: ServeConfig) -> uvicorn.Server:
    # uvicorn builds one protocol object per connection, of a class bound to the deadline
    timeout = {"header_timeout_s": config.header_timeout_s}
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), timeout)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=config.drain_timeout_s,
        lifespan="on",
        http=protocol,
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
    """uvicorn serving ``app`` on a thread, as a context manager; ``port=0`` picks a free
    port (see ``.port``)."""

    START_TIMEOUT_S = 30.0

    def __init__(self, app, config: ServeConfig) -> None:
        self._server = _uvicorn_server(app, config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self.host = config.host

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self.START_TIMEOUT_S
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
