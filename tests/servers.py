"""Real uvicorn servers on loopback for tests, started without waiting on timers.

The listening socket is bound and put in listen mode before the server thread starts, so a
client can connect at once: the kernel queues the connection until uvicorn accepts it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from ckptstore.service.api.server import http_protocol, server_config, tune_uvicorn
from ckptstore.service.settings import Settings


@contextmanager
def running_server(app: FastAPI, settings: Settings | None = None, **overrides: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port, set up as ``ckptstore serve`` runs it.

    With ``settings`` the server is configured as ``ckptstore serve`` configures it for them
    (limits, timeouts), except that this process's logging is left alone (``log_config=None``;
    ``overrides`` change that or any other uvicorn option); without, quietly, with uvicorn's
    default limits. Yields the server's base URL.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    tune_uvicorn()
    if settings is not None:
        options: dict[str, Any] = {"lifespan": "off", "log_config": None, **overrides}
        config: uvicorn.Config = server_config(app, settings, **options)
    else:
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http=http_protocol())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
