"""Building the served application from the environment (what uvicorn's workers import)."""

from __future__ import annotations

from fastapi import FastAPI

from service.api.app import create_app
from service.factory import open_store
from service.settings import Settings


def app_from_env() -> FastAPI:
    """The application for the current ``CKPTSTORE_*`` settings.

    An embedded SQLite database upgrades itself; a PostgreSQL database must already be at
    the current schema (``ckptstore db upgrade``), otherwise the server refuses to start.
    """
    settings = Settings()
    store = open_store(settings, require_current_schema=True)
    return create_app(store, settings)
