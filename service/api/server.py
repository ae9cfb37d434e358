"""Building the served application from the environment (what uvicorn's workers import)."""

from __future__ import annotations

import copy
import ctypes
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from ckptstore.service.api.app import create_app
from ckptstore.service.factory import open_store
from ckptstore.service.intake.direct_file import warm_buffers
from ckptstore.service.intake.receiver import UPLOAD_IN_FLIGHT
from ckptstore.service.settings import Settings

log = logging.getLogger("ckptstore.server")

#: Uploads whose buffers a starting server faults in ahead (the client's uploads in flight).
WARM_UPLOADS = 4
#: How much request body uvicorn buffers per connection before it stops reading the socket.
BODY_BUFFER_BYTES = 4 << 20


def tune_uvicorn() -> None:
    """Let uvicorn buffer up to BODY_BUFFER_BYTES of a request body instead of 64 KiB.

    Its default wakes the app and pauses the socket every 64 KiB, so a 1 GiB shard upload
    costs 16,000 trips through the event loop; 4 MiB pieces cut that 64-fold at 4 MiB of
    memory per uploading connection. A uvicorn without the setting is left as it is.
    """
    try:
        from uvicorn.protocols.http import h11_impl, httptools_impl
    except ImportError:  # httptools missing: uvicorn uses h11 alone
        from uvicorn.protocols.http import h11_impl

        modules = [h11_impl]
    else:
        modules = [h11_impl, httptools_impl]
    for module in modules:
        current = getattr(module, "HIGH_WATER_LIMIT", None)
        if isinstance(current, int):
            setattr(module, "HIGH_WATER_LIMIT", max(current, BODY_BUFFER_BYTES))  # noqa: B010


#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations up to this size come from the heap, which keeps up to KEEP_FREE_BYTES free for reuse.
HEAP_ALLOCATION_BYTES = 32 << 20
KEEP_FREE_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Keep the multi-MiB buffers of shard uploads and downloads in glibc's heap, and reuse them.

    Every download piece is a new 4 MiB buffer (uvloop may still hold the last one), and an
    upload's body arrives in pieces the parser allocates. By default glibc maps large blocks
    separately or gives a freed heap top back to the kernel, so each new buffer is memory the
    kernel must fault in again; on a VM whose fresh memory is slow that cost 7-17 % of an HTTP
    load. Returns False where there is no glibc (nothing changed).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATION_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES))


def http_protocol() -> str:
    """uvicorn's ``http`` setting: its httptools protocol that hands request bodies over without
    copying them (:mod:`service.api.http.protocol`), or uvicorn's own choice without httptools."""
    try:
        import ckptstore.service.api.http.protocol  # noqa: F401  (imports httptools)
    except ImportError:
        return "auto"
    return "ckptstore.service.api.http.protocol:PiecewiseBodyProtocol"


class ServerConfig(uvicorn.Config):
    """uvicorn's Config plus the read and write timeouts :class:`service.api.http.protocol.PiecewiseBodyProtocol`
    applies.

    A plain attribute travels with the Config to each worker process, which uvicorn spawns with
    the Config pickled.
    """

    def __init__(
        self,
        app: Any,
        *,
        header_timeout: float,
        body_timeout: float,
        min_body_rate: int,
        write_timeout: float,
        **kwargs: Any,
    ):
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.min_body_rate = min_body_rate
        self.write_timeout = write_timeout


def log_config() -> dict[str, Any]:
    """uvicorn's logging set-up with :class:`service.api.redact.RedactTokens` on every handler.

    A handler's filter sees every record the handler writes, the service's own loggers
    (``ckptstore.*``, written through uvicorn's default handler) included.
    """
    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": "ckptstore.service.api.redact.RedactTokens"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["loggers"]["ckptstore"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def server_config(app: Any, settings: Settings, **overrides: Any) -> ServerConfig:
    """How ``ckptstore serve`` runs uvicorn for ``settings``: the service's HTTP protocol, the
    limits and timeouts of the settings, and logs that never carry a token.

    ``app`` is the application, or ``"ckptstore.service.api.server:app_from_env"`` for several workers.
    """
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "workers": settings.workers,
        "factory": isinstance(app, str),
        "http": http_protocol(),
        "log_config": log_config(),
        "log_level": "info",
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "header_timeout": settings.header_timeout,
        "body_timeout": settings.body_timeout,
        "min_body_rate": settings.min_body_rate,
        "write_timeout": settings.write_timeout,
    }
    options.update(overrides)
    return ServerConfig(app, **options)


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (as uvicorn binds one, ``SO_REUSEADDR``
    set): from here on a client's connection waits in the kernel's queue until the server
    accepts it, so the server may say where it serves.

    Raises:
        OSError: the address cannot be bound (``EADDRINUSE``: another process listens there).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)  # for the worker processes of several workers
    return sock


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's server that, given its sockets, still logs where it runs once started (uvicorn
    leaves that to ``bind_socket``), then calls ``announce``."""

    def __init__(self, config: ServerConfig, announce: Callable[[], object] | None) -> None:
        super().__init__(config=config)
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            self._log_started_message(sockets)
        if self.started and self.announce is not None:
            self.announce()


def run(config: ServerConfig, sock: socket.socket | None = None, announce: Callable[[], object] | None = None) -> None:
    """Serve with ``config`` until stopped: in this process, or in ``config.workers`` processes
    (what ``uvicorn.run`` does with the same Config), on ``sock`` when given (see
    :func:`listening_socket`); ``announce`` is called once the server has started (with several
    workers, once the socket listens). Exits with status 3 if the server did not start."""
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    if config.workers == 1:
        config.load_app()
    server = _AnnouncingServer(config, announce)
    try:
        if config.workers > 1:
            if sock is not None:  # as config.bind_socket() would have logged it
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, port
                )
            if announce is not None:
                announce()
            Multiprocess(config, sockets=[sock if sock is not None else config.bind_socket()]).run()
        else:
            server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:
        pass
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started and config.workers == 1:
        sys.exit(STARTUP_FAILURE)


def app_from_env() -> FastAPI:
    """The application for the current ``CKPTSTORE_*`` settings.

    An embedded SQLite database upgrades itself; a PostgreSQL database must already be at
    the current schema (``ckptstore db upgrade``), otherwise the server refuses to start.
    Temporary shard files that a killed server or client left in the staging folders are
    deleted first: those no live process holds (another worker's uploads are held and kept;
    :mod:`service.reclaim.cleanup`); the staging disk's write mode is settled
    (:meth:`Store.prepare_writes`), and the buffers of four uploads at once are faulted in
    ahead (they stay pooled once used anyway).
    uvicorn and glibc malloc are tuned for multi-MiB bodies (:func:`tune_uvicorn`,
    :func:`tune_malloc`).
    """
    tune_uvicorn()
    tune_malloc()
    settings = Settings()
    store = open_store(settings, require_current_schema=True)
    cleaned = store.clean_staging()
    if cleaned.removed or cleaned.failed:
        log.warning(
            "removed %d abandoned temporary shard files (%d bytes) from %s; %d could not be removed",
            cleaned.removed,
            cleaned.bytes_removed,
            store.staging_dir,
            cleaned.failed,
        )
    store.prepare_writes()  # the disk's write mode is measured now, not during the first upload
    warm_buffers(WARM_UPLOADS * (UPLOAD_IN_FLIGHT + 1))  # each upload's staging file buffers
    application = create_app(store, settings)
    freeze_heap()
    share_gil()
    return application


def freeze_heap() -> None:
    """Exempt everything alive now (modules, the app, the store) from cyclic garbage collection.

    A full collection walks every tracked object holding the GIL, which with the service's
    imports alone stalled the event loop for 60-80 ms whenever a request allocating a lot (a
    digest list of 100,000) set one off; frozen, the start-up objects are never walked again.
    """
    gc.collect()
    gc.freeze()


#: How often a thread holding the GIL is made to offer it to others (Python's default: 5 ms).
SWITCH_INTERVAL = 0.001


def share_gil() -> None:
    """Make a thread that parses a large body give the GIL up every millisecond, not every five.

    Answering one request takes the event loop and a worker thread several turns at the GIL;
    while another worker parses a large body, each turn waited up to 5 ms, /healthz took 20 ms
    at the median and its slowest answers passed 100 ms. Bodies parse a little slower for it.
    """
    sys.setswitchinterval(SWITCH_INTERVAL)
