"""A real server for page tests on PostgreSQL, with read and write tokens (tests.pages.kit.TOKENS)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database, schema
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.kit import TOKENS
from tests.servers import running_server


@contextmanager
def served_on_postgres(postgres_databases: Any, home: Path) -> Iterator[str]:
    """Serve a store on a fresh PostgreSQL database (blobs under ``home``); yields the base URL."""
    url = postgres_databases.create()
    database = Database(url)
    schema.upgrade(database)
    store = Store(database, LocalBlobStore(home / "blobs"), home / "staging")
    settings = Settings(home=home, database_url=url, tokens=TOKENS)
    try:
        with running_server(create_app(store, settings)) as base_url:
            yield base_url
    finally:
        store.close()
