"""The outermost layer of the app: header-size cap, request counting and timing, as plain ASGI.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``: that one wraps every ``receive``
of a request body in a new task group, which costs more than the bytes themselves when a
shard upload arrives in thousands of chunks.
"""

from __future__ import annotations

import time

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptstore.service.api.errors import error_response
from ckptstore.service.api.metrics import Metrics
from ckptstore.service.errors import PayloadTooLargeError

MAX_HEADER_BYTES = 64 << 10


class CountAndLimit:
    """Refuse oversized request headers (431), count requests by route and status, add Server-Timing.

    Args:
        app: the application inside.
        metrics: where request counts go.
        max_json_bytes: the ``max_json_bytes`` setting, the ceiling of every route's JSON body
            limit (:mod:`service.api.http.body_limits`), handed to routes through the scope.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, max_json_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_json_bytes = max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection scope."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # uvicorn's httptools parser does not cap header size, so the app does.
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            refusal = error_response(
                431,
                PayloadTooLargeError.code,
                f"request headers are {header_bytes} bytes; the limit is {MAX_HEADER_BYTES}",
            )
            await refusal(scope, receive, send)
            return
        scope["ckptstore.max_json_bytes"] = self.max_json_bytes
        started = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers.append("Server-Timing", f"app;dur={(time.perf_counter() - started) * 1000:.1f}")
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.count_request(scope["method"], path, status)
