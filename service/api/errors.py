"""The one place where exceptions become HTTP responses.

A CheckpointError becomes its ``http_status`` with an ``X-Error-Code`` header and a JSON body
``{"code", "message"}``; the client maps the code back to the same exception class.
Validation errors, HTTP errors and anything unexpected get the same shape; an unexpected
error is logged and answered 500 without internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import CheckpointError, MissingTensorsError, RangeNotSatisfiableError

log = logging.getLogger("ckptstore.api")

HTTP_CODES = {
    400: "invalid_input",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    411: "length_required",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "invalid_input",
}


def error_response(status: int, code: str, message: str, **extra: object) -> JSONResponse:
    """A JSON error response with the ``X-Error-Code`` header."""
    headers = {"X-Error-Code": code}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"code": code, "message": message, **{k: v for k, v in extra.items() if v is not None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _describe(exc: RequestValidationError) -> tuple[int, str]:
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            return 400, f"invalid JSON body: {error.get('ctx', {}).get('error', 'not JSON')}"
    parts = []
    for error in errors[:8]:
        location = "/".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', '')}")
    more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
    return 422, "invalid request: " + "; ".join(parts) + more


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(CheckpointError)
    async def checkpoint_error(_request: Request, exc: CheckpointError) -> JSONResponse:
        digests = exc.digests[:1000] if isinstance(exc, MissingTensorsError) else None
        response = error_response(exc.http_status, exc.code, exc.message, digests=digests)
        if isinstance(exc, RangeNotSatisfiableError) and exc.size is not None:
            response.headers["Content-Range"] = f"bytes */{exc.size}"  # RFC 9110 §15.5.17
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = _describe(exc)
        return error_response(status, "invalid_input", message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal server error; the server log has the details")
