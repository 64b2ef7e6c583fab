"""Raw ASGI middleware in front of every route: API-key auth, then the body size limit.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ragserve.server.errors import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})


async def _send_error(send: Send, status: int, message: str, headers=()) -> None:
    body = error_bytes(status, message)
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """Rejects unauthenticated requests (401) and bodies over ``max_body_bytes`` (413).

    With ``api_key`` set, every path but ``/health`` needs ``Authorization: Bearer <key>``.
    The request body is read in full here (it is small by construction) and replayed to the
    app; after it, ``receive`` is the server's own, so disconnects still reach the app.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_error(
                send, 401, "missing or invalid API key", [(b"www-authenticate", b"Bearer")]
            )
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(send, 413, self._too_large(declared))
            return
        chunks, size, tail = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                tail = message  # an early disconnect: hand it to the app as is
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, 413, self._too_large(size))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), tail, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or scope.get("path") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False

    def _too_large(self, size: int) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, tail: Message | None, receive: Receive) -> Receive:
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if tail is not None:
        pending.append(tail)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
