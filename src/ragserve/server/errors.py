"""Errors in OpenAI's wire format, ``{"error": {"message", "type", "param", "code"}}``, for every
failure the HTTP front returns (FastAPI's 422 becomes a 400, as OpenAI's), and the mapping of
backend failures to HTTP statuses."""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    499: "request_aborted",
    500: "internal_server_error",
    503: "service_unavailable",
}
# ``Response.error_kind`` (or ``RequestError.kind``) -> (HTTP status, error code)
KIND_STATUS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request"),
    "overloaded": (429, "too_many_requests"),
    "worker_died": (503, "worker_died"),
    "timeout": (503, "worker_timeout"),
    "aborted": (499, "aborted"),
    "internal": (500, "internal_error"),
}


class APIError(StarletteHTTPException):
    """An error with an HTTP status, raised by handlers and rendered in OpenAI's format."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, message, headers)
        self.message = message
        self.param = param
        self.code = code


def model_not_found(message: str, param: str | None = "model") -> APIError:
    """The 404 of a model (workflow, LLM, embedder or tokenizer) this server does not serve."""
    return APIError(404, message, param=param, code="model_not_found")


def error_body(status_code: int, message: str, *, param=None, code=None) -> dict:
    kind = _TYPES.get(status_code, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(status_code: int, message: str, code: str | None = None) -> bytes:
    """The same body, pre-encoded, for raw ASGI and the h11 protocol."""
    return json.dumps(error_body(status_code, message, code=code)).encode()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_for_kind(kind: str | None, message: str, request_id: str | None = None) -> APIError:
    """The HTTP error for a failed request of ``kind`` (an ``ErrorKind``; unknown: 500). An
    internal error's text stays in the server log under the request id the client gets."""
    kind = kind if kind in KIND_STATUS else "internal"
    status, code = KIND_STATUS[kind]
    if status >= 500:
        request_id = request_id or new_request_id("error")
        logger.error("request %s failed in the backend (%s): %s", request_id, kind, message)
        if kind == "internal":
            message = f"internal error (request id {request_id}); details are in the server log"
    return APIError(status, message, code=code)


def backend_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """A backend failure as an HTTP error: by the exception's ``kind`` (``RequestError``),
    else a ``ValueError`` is 400 (bad input) and anything else 500."""
    if isinstance(exc, APIError):
        return exc
    kind = getattr(exc, "kind", None)
    if kind in KIND_STATUS:
        return error_for_kind(kind, str(exc), request_id)
    if isinstance(exc, ValueError):
        return error_for_kind("bad_request", str(exc), request_id)
    return error_for_kind("internal", f"{type(exc).__name__}: {exc}", request_id)


def _format_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        msg = str(err.get("msg")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"malformed JSON body: {ctx.get('error', msg)}")
            continue
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or (where or None)
        parts.append(f"{where}: {msg}" if where else f"request body: {msg}")
    return "; ".join(parts) or "invalid request body", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)  # APIError and Starlette's own (404, 405)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        param, code = getattr(exc, "param", None), getattr(exc, "code", None)
        body = error_body(exc.status_code, str(exc.detail), param=param, code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation(exc)
        body = error_body(400, message, param=param, code="invalid_request")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "unknown")
        logger.exception("request %s: unhandled error in the HTTP front", request_id)
        message = f"internal error (request id {request_id}); details are in the server log"
        return JSONResponse(error_body(500, message, code="internal_error"), status_code=500)
