"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the HTTP front returns goes through :func:`error_response`, so clients (the
``openai`` package included) see one shape. FastAPI's 422 for invalid bodies is turned into a
400, as OpenAI does.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_aborted",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status, raised by handlers and rendered by :func:`error_response`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status_code: int, message: str, *, param=None, code=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status_code: int, message: str, *, param=None, code=None, headers=None
) -> JSONResponse:
    body = error_body(status_code, message, param=param, code=code)
    return JSONResponse(body, status_code=status_code, headers=headers)


def error_bytes(status_code: int, message: str, *, code: str | None = None) -> bytes:
    """The same body, pre-encoded, for the raw-ASGI middleware."""
    return json.dumps(error_body(status_code, message, code=code)).encode()


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
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation(exc)
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "unknown")
        logger.exception("request %s: unhandled error in the HTTP front", request_id)
        message = f"internal error (request id {request_id}); details are in the server log"
        return error_response(500, message, code="internal_error")
