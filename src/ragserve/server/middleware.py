"""Raw ASGI middleware in front of every route (so streams and disconnects pass untouched): a
request id, API-key auth, then the body limits (size, read deadline, JSON nesting depth)."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragserve.server.config import ServeConfig
from ragserve.server.errors import error_bytes

OPEN_PATHS = frozenset({"/health"})
REQUEST_ID_HEADER = b"x-request-id"
# a JSON string, or an unterminated one to the end (invalid JSON: the parser rejects it);
# possessive, so each string is matched once from its opening quote (linear)
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# JSON bytes -> +1 (opening bracket), 255 (closing: -1 as int8), 0 (anything else)
_DEPTH_TABLE = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))


def json_depth(body: bytes) -> int:
    """How deep ``body``'s arrays/objects nest (brackets inside strings skipped), before any
    parser recurses into it."""
    if b"[" not in body and b"{" not in body:
        return 0
    return _bracket_depth(_JSON_STRING.sub(b"", body) if b'"' in body else body)


def _bracket_depth(body: bytes) -> int:
    """Depth counting every bracket, strings included: an upper bound of ``json_depth``."""
    steps = np.frombuffer(body.translate(_DEPTH_TABLE), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


async def _send_error(send: Send, status: int, message: str, headers=()) -> None:
    body = error_bytes(status, message)
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": [*head, *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    """Rejects unauthenticated requests (401; with ``api_key`` set, every path but ``/health``
    needs ``Authorization: Bearer <key>``), bodies over ``max_body_bytes`` (413), bodies not
    received within ``body_timeout_s`` (408) and JSON nested deeper than ``max_json_depth``
    (400). Every response carries ``X-Request-Id`` (also in ``scope["state"]``). The body is
    read in full here and replayed to the app, then ``receive`` is the server's own again.
    """

    def __init__(self, app: ASGIApp, *, config: ServeConfig) -> None:
        self.app = app
        self.expected = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        self.max_body_bytes = config.max_body_bytes
        self.body_timeout_s = config.body_timeout_s
        self.max_json_depth = config.max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        send = _with_request_id(send, request_id.encode())
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
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                msg = f"request body not received within {self.body_timeout_s:g} s"
                await _send_error(send, 408, msg, [(b"connection", b"close")])
                return
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
        body = b"".join(chunks)
        # NOTE: the bracket count is a fast upper bound; only a body over it (brackets inside
        # strings, or a hostile one) pays for the exact count, off the event loop.
        if _bracket_depth(body) > self.max_json_depth and (
            await asyncio.to_thread(json_depth, body) > self.max_json_depth
        ):
            msg = f"request body nests deeper than {self.max_json_depth} levels"
            await _send_error(send, 400, msg)
            return
        await self.app(scope, _replay(body, tail, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or scope.get("path") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False

    def _too_large(self, size: int) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes"


def _with_request_id(send: Send, request_id: bytes) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id)]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _content_length(scope: Scope) -> int | None:
    value = dict(scope.get("headers", ())).get(b"content-length", b"")
    return int(value) if value.isdigit() else None


def _replay(body: bytes, tail: Message | None, receive: Receive) -> Receive:
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    pending += [tail] if tail is not None else []

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
