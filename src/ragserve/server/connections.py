"""Connection-level bounds uvicorn's h11 protocol lacks: a deadline for request headers.

uvicorn closes an idle kept-alive connection after ``timeout_keep_alive``, but a client that
opens a socket and sends nothing, or a few bytes of headers (slowloris), holds it forever.
``header_timeout_protocol(seconds)`` is an ``H11Protocol`` that arms a timer whenever it
waits for a request's headers (a new connection, or the next request on a kept-alive one
once its first byte arrives) and closes the connection if they are not complete in time
(408 when some bytes came, a plain close when none did). Body deadlines are the
middleware's (``GuardMiddleware``).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class HeaderTimeoutProtocol(H11Protocol):
    """``H11Protocol`` with ``header_timeout_s`` (set by ``header_timeout_protocol``)."""

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
            body = (
                b'{"error": {"message": "request headers not received in time", '
                b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}'
            )
            self.transport.write(_TIMEOUT_RESPONSE % (len(body), body))
        logger.debug("closing a connection whose request headers did not arrive in time")
        self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A ``HeaderTimeoutProtocol`` class bound to ``header_timeout_s`` (uvicorn builds one
    protocol object per connection from the class it is given)."""
    return type(
        "HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s}
    )
