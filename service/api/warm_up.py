"""Doing at a worker's start what it would otherwise do during its first requests.

FastAPI builds an included router's routes (their dependencies, body and response models) the
first time a request is matched against them, and anyio imports its asyncio backend the first
time a route runs work on a thread. Measured in-process on a 2-core VM: a fresh app's first
``/healthz`` took 67 ms against 2 ms for the next, and ``ckptstore serve`` answered each
worker's first request 40 ms late, a cost a save paid whenever it was the first client of a
worker. :func:`warm_up` runs in the app's lifespan, before uvicorn opens the worker to
connections: one request for a path no route has, handed to the router itself (so no metrics
count it and no access log line tells of it), which matches it against every route on its way
to the 404, and one call on a worker thread.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import Message

#: A path no route has: the router tries every route before answering 404.
NO_ROUTE = "/.ckptstore-warm-up"


async def warm_up(app: FastAPI) -> None:
    """Build every route of ``app`` and start the thread pool, as its first requests would."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": NO_ROUTE,
        "raw_path": NO_ROUTE.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost")],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass  # the 404 is nobody's

    await app.router(scope, receive, send)
    await run_in_threadpool(lambda: None)
