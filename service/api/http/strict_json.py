"""A route class whose JSON bodies are capped per route, then parsed and validated on a worker thread.

FastAPI reads a body whole, parses it with ``json.loads`` (duplicate keys, NaN, RecursionError
on deep nesting) and validates it, all on the event loop: one large body stalls every other
client. Routes built with :class:`StrictJSONRoute` instead

1. check the caller's scope first (no token, no body read);
2. read the body against the route's own limit (:mod:`service.api.http.body_limits`), refusing it
   with 413 as soon as ``Content-Length`` or the bytes received pass it;
3. parse it strictly (:func:`service.format.jsondoc.parse_json`) and validate it against the
   route's body model on a worker thread, so the event loop keeps serving other requests.

FastAPI then receives the validated model in place of the parsed JSON and accepts it as it is.
"""

from __future__ import annotations

import contextlib
import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ckptstore.service.api.deps import ScopeCheck
from ckptstore.service.api.errors import not_json_message
from ckptstore.service.api.http.body_limits import BodyLimit, limit_for
from ckptstore.service.api.http.gc_pauses import gc_paused, in_body_thread, release, release_later
from ckptstore.service.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaTypeError
from ckptstore.service.format.jsondoc import parse_json

#: Where the middleware puts the ``max_json_bytes`` setting, the ceiling of every JSON body.
CEILING_KEY = "ckptstore.max_json_bytes"
DEFAULT_MAX_JSON_BYTES = 8 << 20
#: What ``body()`` returns once the body has been parsed: non-empty, so FastAPI reads ``json()``.
PARSED = b"{}"
#: From this size on, a body is handled with cyclic garbage collection paused (:mod:`service.api.http.gc_pauses`).
GC_PAUSE_BYTES = 256 << 10


class StrictJSONRequest(Request):
    """A request whose ``json()`` is the body model a worker thread validated (see :func:`decode`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # Only for a route whose body fields are embedded (none today): a small body, already
            # read against the small limit, parsed here.
            try:
                self._json = parse_json(await self.body())
            except InvalidInputError as exc:
                raise json.JSONDecodeError(exc.message, "", 0) from exc
        return self._json


async def read_body(request: Request, limit: int, label: str, setting: str | None) -> bytes:
    """The request's body, refused with 413 once it is known to pass ``limit`` bytes.

    ``label`` names the route ("POST /v1/tensors/locate") and ``setting`` the variable that
    raises the limit, both for the message. Nothing past the limit is buffered.
    """
    raise_hint = f"; raise it with {setting}" if setting else ""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(
            f"the request body is {declared} bytes; {label} accepts at most {limit} bytes{raise_hint}"
        )
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(
                    f"the request body passed {limit} bytes, the most {label} accepts{raise_hint}"
                )
            chunks.append(chunk)
    except ClientDisconnect as exc:  # the client went away, or was dropped for sending too slowly
        raise InvalidInputError(f"the request body was cut off after {size} bytes") from exc
    body = b"".join(chunks)
    del chunks
    request._body = body
    return body


def decode(body: bytes, limit: BodyLimit, validate: Callable[[Any], tuple[Any, list[Any]]]) -> Any:
    """Parse ``body`` strictly and validate it; meant for a worker thread.

    Raises RequestValidationError shaped as FastAPI's own: ``json_invalid`` for a body that is
    not acceptable JSON (answered 400), the model's errors otherwise (422).
    """
    try:
        limit.check_shape(body)
        value = parse_json(body)
    except InvalidInputError as exc:
        error = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.message}}]) from exc
    validated, errors = validate(value)
    release([value])
    del value
    if errors:
        raise RequestValidationError([_small(error) for error in errors])
    return validated


def _small(error: dict[str, Any]) -> dict[str, Any]:
    """A validation error without a large input: an error outlives the thread, and freeing a
    parsed tree of millions of objects on the event loop would stall it."""
    value = error.get("input")
    if isinstance(value, (dict, list)) or (isinstance(value, str) and len(value) > 200):
        return {**error, "input": None}
    return error


def wants_json(request: Request, strict_content_type: bool) -> bool:
    """Whether FastAPI will read this request's body as JSON (its own test, repeated)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return not strict_content_type
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class StrictJSONRoute(APIRoute):
    """Routes built with this class receive :class:`StrictJSONRequest` objects.

    The route's scope checks run before anything else: FastAPI reads and parses a JSON body
    before it solves dependencies, which would let a caller without a token make the server
    buffer a body and answer 400/413 instead of 401.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        checks = [d.dependency for d in self.dependencies if isinstance(d.dependency, ScopeCheck)]
        has_body = self.body_field is not None
        # One body model, not embedded: the JSON is that model, validated here off the loop.
        field = self.body_field if has_body and not self._embed_body_fields else None
        limit = limit_for(field.field_info.annotation if field is not None else None)
        strict_type = getattr(self.strict_content_type, "value", self.strict_content_type)
        label = f"{'/'.join(sorted(self.methods or ()))} {self.path}"

        def validate(value: Any) -> tuple[Any, list[Any]]:
            assert field is not None
            return field.validate(value, {}, loc=("body",))

        async def strict_handler(request: Request) -> Response:
            strict = StrictJSONRequest(request.scope, request.receive)
            for check in checks:
                check(strict)
            if not has_body:
                return await handler(strict)
            if field is not None and not wants_json(strict, True):
                # Even with no body: a cross-site page can send a "simple" POST (text/plain, or no
                # type) without asking first, never one typed application/json (:mod:`.same_site`).
                raise UnsupportedMediaTypeError(not_json_message(strict.headers.get("content-type")))
            ceiling = int(strict.scope.get(CEILING_KEY, DEFAULT_MAX_JSON_BYTES))
            body = await read_body(strict, limit.bytes_within(ceiling), label, limit.setting_for(ceiling))
            if field is None or not body or not wants_json(strict, bool(strict_type)):
                return await handler(strict)
            with gc_paused() if len(body) >= GC_PAUSE_BYTES else contextlib.nullcontext():
                strict._json = await in_body_thread(decode, body, limit, validate)
                # FastAPI asks for the body again, only to see that there is one, then takes the
                # model from json(): the bytes need not be kept while the route runs.
                strict._body = PARSED
                del body
                try:
                    return await handler(strict)
                finally:
                    release_later(strict.__dict__.pop("_json"))

        return strict_handler
