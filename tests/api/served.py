"""A real uvicorn server over a store on SQLite or on a fresh PostgreSQL database, seeded with one run.

The seeded run ``SEEDED_RUN`` holds version 1 (tagged ``SEEDED_TAG``), committed over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database, schema
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, build_shard, commit_body, entry, tensor
from tests.backends import PostgresDatabases
from tests.servers import running_server

SEEDED_RUN = "seeded"
SEEDED_TAG = "best"
SEEDED_SHARD = build_shard(tensor(11, "F32", (4, 4)), tensor(12, "I64", (3,)))
SEEDED_BODY = commit_body(
    entry("model/w", SEEDED_SHARD.tensors[0]), entry("model/b", SEEDED_SHARD.tensors[1]), tags=[SEEDED_TAG]
)


@dataclass
class ServedStore:
    """A running server (``url``) and the store it serves (``store``, for checks behind its back)."""

    url: str
    store: Store

    def client(self, scope: str | None = None) -> httpx.Client:
        """An httpx client for the server, with a token of ``scope`` if given."""
        return httpx.Client(base_url=self.url, timeout=60, headers=bearer(scope) if scope else {})


def open_backend_store(kind: str, folder: Path, databases: PostgresDatabases) -> Store:
    """A store on SQLite (embedded, in ``folder``) or on a new PostgreSQL database, blobs in ``folder``."""
    if kind == "sqlite":
        return Store.open_home(folder)
    url = databases.create()
    database = Database(url)
    schema.upgrade(database)
    return Store(database, LocalBlobStore(folder / "blobs"), folder / "staging")


def seed(url: str) -> None:
    """Upload the seeded shard and commit version 1 of the seeded run over HTTP."""
    with httpx.Client(base_url=url, timeout=60, headers=bearer("write")) as http:
        upload = http.put(f"/v1/shards/{SEEDED_SHARD.shard_id}", content=SEEDED_SHARD.data)
        assert upload.status_code in (200, 201), upload.text
        committed = http.post(f"/v1/runs/{SEEDED_RUN}/versions", json=SEEDED_BODY)
        assert committed.status_code == 201 and committed.json()["version"] == 1, committed.text


@contextmanager
def served_store(kind: str, folder: Path, databases: PostgresDatabases) -> Iterator[ServedStore]:
    """A seeded store of ``kind`` ('sqlite' or 'postgresql') behind a real server with three tokens."""
    store = open_backend_store(kind, folder, databases)
    try:
        with running_server(create_app(store, Settings(home=folder, tokens=TOKENS))) as url:
            seed(url)
            yield ServedStore(url, store)
    finally:
        store.close()
