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

from ckptstore.service.errors import (
    CheckpointError,
    MissingTensorsError,
    RangeNotSatisfiableError,
    ServerBusyError,
    StorageError,
    StorageFullError,
    UnsupportedMediaTypeError,
    is_disk_full,
)

log = logging.getLogger("ckptstore.api")

HTTP_CODES = {
    400: "invalid_input",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    411: "length_required",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "invalid_input",
    507: StorageFullError.code,
}


def error_response(status: int, code: str, message: str, **extra: object) -> JSONResponse:
    """A JSON error response with the ``X-Error-Code`` header."""
    headers = {"X-Error-Code": code}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"code": code, "message": message, **{k: v for k, v in extra.items() if v is not None}}
    return JSONResponse(body, status_code=status, headers=headers)


#: Validation errors of a number outside its bounds: the message shows the number sent.
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
STORAGE_MESSAGE = (
    "storage is unavailable: the server could not use its metadata database or blob store; "
    "retry shortly (the server's log has the cause)"
)


def _shown(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"a number of {value.bit_length()} bits"  # str() of a huge int is slow, refused past 4300 digits
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _not_json(request: Request, exc: RequestValidationError) -> str | None:
    """Why a JSON body was not read as JSON (its Content-Type), or None if it was.

    FastAPI reads a body as JSON only when it is sent as ``application/json`` (or ``+json``);
    otherwise the route's model gets the raw bytes, which it refuses as "not an object".
    """
    if not any(error.get("loc") == ("body",) and isinstance(error.get("input"), bytes) for error in exc.errors()):
        return None
    return not_json_message(request.headers.get("content-type"))


def not_json_message(content_type: str | None) -> str:
    """Why a body sent with ``content_type`` (or none) is not read as JSON, and how to send it."""
    sent = f"is sent as {_shown(content_type.split(';', 1)[0].strip())!r}" if content_type else "has no Content-Type"
    return (
        f"the request body {sent}, so it was not read as JSON: send it with 'Content-Type: application/json' "
        "(curl: --json, or -H 'Content-Type: application/json' with -d; '{}' for a body of defaults)"
    )


def _route(request: Request) -> str:
    """The route's path template (``/v1/runs/{run_id}/versions``), else the path as sent."""
    return str(getattr(request.scope.get("route"), "path", "")) or _shown_path(request.url.path)


def _shown_path(path: str) -> str:
    return path if len(path) <= 120 else path[:117] + "..."


def _no_route(request: Request) -> str:
    """A 404 for a path no route matches, naming it; a '/' sent encoded inside an id is explained."""
    raw = bytes(request.scope.get("raw_path") or b"").decode("latin-1")
    if "%2f" in raw.lower():
        return (
            f"no route matches {_shown_path(raw)!r}: a '/' sent as %2F is still a '/', and no run id, tag, "
            "version reference or shard id may contain one (they use only A-Z a-z 0-9 . _ -)"
        )
    return f"no route matches {request.method} {_shown_path(request.url.path)!r}; the API's routes are at /openapi.json"


def public_message(request: Request, exc: CheckpointError) -> str:
    """The message a client is shown for ``exc``.

    A storage failure is logged here with its cause (a database driver's or blob store's text,
    which is for the operator) and answered with :data:`STORAGE_MESSAGE` and the request alone;
    but a full disk is no passing failure, and its message (which folder is full, what to run)
    is the answer.
    """
    if isinstance(exc, StorageFullError):
        log.error("disk full on %s %s: %s", request.method, _route(request), exc.message)
        return exc.message
    if isinstance(exc, StorageError):
        log.error("storage failed on %s %s: %s", request.method, _route(request), exc.message, exc_info=exc)
        return f"{request.method} {_shown_path(request.url.path)}: {STORAGE_MESSAGE}"
    return exc.message


def _describe(exc: RequestValidationError) -> tuple[int, str]:
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            return 400, f"invalid JSON body: {error.get('ctx', {}).get('error', 'not JSON')}"
    parts = []
    for error in errors[:8]:
        location = "/".join(str(p) for p in error.get("loc", ()) if p != "body")
        sent = f" ({_shown(error.get('input'))} was sent)" if error.get("type") in _BOUND_ERRORS else ""
        parts.append(f"{location or 'body'}: {error.get('msg', '')}{sent}")
    more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
    return 422, "invalid request: " + "; ".join(parts) + more


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(CheckpointError)
    async def checkpoint_error(request: Request, exc: CheckpointError) -> JSONResponse:
        digests = exc.digests[:1000] if isinstance(exc, MissingTensorsError) else None
        response = error_response(exc.http_status, exc.code, public_message(request, exc), digests=digests)
        if isinstance(exc, RangeNotSatisfiableError) and exc.size is not None:
            response.headers["Content-Range"] = f"bytes */{exc.size}"  # RFC 9110 §15.5.17
        if isinstance(exc, ServerBusyError):
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        not_json = _not_json(request, exc)
        if not_json is not None:
            return error_response(UnsupportedMediaTypeError.http_status, UnsupportedMediaTypeError.code, not_json)
        status, message = _describe(exc)
        return error_response(status, "invalid_input", message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 404 and request.scope.get("route") is None:
            message = _no_route(request)
        return error_response(exc.status_code, code, message)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        if is_disk_full(exc):  # a full disk some write path did not name: still a full disk, not a bug
            full = StorageFullError.of_folder("the server's store", getattr(exc, "strerror", None) or exc)
            return await checkpoint_error(request, full)
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal server error; the server log has the details")
