"""Building the served application from the environment (what uvicorn's workers import)."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from service.api.app import create_app
from service.factory import open_store
from service.settings import Settings

log = logging.getLogger("ckptstore.server")


def app_from_env() -> FastAPI:
    """The application for the current ``CKPTSTORE_*`` settings.

    An embedded SQLite database upgrades itself; a PostgreSQL database must already be at
    the current schema (``ckptstore db upgrade``), otherwise the server refuses to start.
    Temporary shard files that a killed server or client left in the staging folders more
    than an hour ago are deleted first (younger ones may belong to another live worker).
    """
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
