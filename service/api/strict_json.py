"""A route class whose JSON bodies are size-capped and parsed strictly.

FastAPI parses bodies with ``json.loads``, which accepts duplicate keys (last wins), NaN and
Infinity, and raises RecursionError on deep nesting. This route class reads at most
``max_json_bytes`` and parses with :func:`service.format.jsondoc.parse_json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from service.api.deps import ScopeCheck
from service.errors import InvalidInputError
from service.format.jsondoc import parse_json

DEFAULT_MAX_JSON_BYTES = 256 << 20


class StrictJSONRequest(Request):
    """A request whose ``body()`` is capped and whose ``json()`` is strict."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = int(self.scope.get("ckptstore.max_json_bytes", DEFAULT_MAX_JSON_BYTES))
            declared = self.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise HTTPException(413, f"request body is {declared} bytes; the limit is {limit}")
            chunks = []
            size = 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except InvalidInputError as exc:
                # FastAPI turns JSONDecodeError into a validation error carrying this message.
                raise json.JSONDecodeError(exc.message, "", 0) from exc
        return self._json


class StrictJSONRoute(APIRoute):
    """Routes built with this class receive :class:`StrictJSONRequest` objects.

    The route's scope checks run before anything else: FastAPI reads and parses a JSON body
    before it solves dependencies, which would let a caller without a token make the server
    buffer up to ``max_json_bytes`` and answer 400/413 instead of 401.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        checks = [d.dependency for d in self.dependencies if isinstance(d.dependency, ScopeCheck)]

        async def strict_handler(request: Request) -> Response:
            strict = StrictJSONRequest(request.scope, request.receive)
            for check in checks:
                check(strict)
            return await handler(strict)

        return strict_handler
