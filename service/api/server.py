"""Building the served application from the environment (what uvicorn's workers import)."""

from __future__ import annotations

import ctypes
import logging

from fastapi import FastAPI

from service.api.app import create_app
from service.factory import open_store
from service.settings import Settings

log = logging.getLogger("ckptstore.server")

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
    copying them (:mod:`service.api.protocol`), or uvicorn's own choice without httptools."""
    try:
        import service.api.protocol  # noqa: F401  (imports httptools)
    except ImportError:
        return "auto"
    return "service.api.protocol:PiecewiseBodyProtocol"


def app_from_env() -> FastAPI:
    """The application for the current ``CKPTSTORE_*`` settings.

    An embedded SQLite database upgrades itself; a PostgreSQL database must already be at
    the current schema (``ckptstore db upgrade``), otherwise the server refuses to start.
    Temporary shard files that a killed server or client left in the staging folders more
    than an hour ago are deleted first (younger ones may belong to another live worker).
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
    return create_app(store, settings)
