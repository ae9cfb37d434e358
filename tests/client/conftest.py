"""The client suite runs three ways: embedded; HTTP over SQLite + a local folder; HTTP over
PostgreSQL + S3. Each test gets an empty store and a real uvicorn server where one is used."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.blobs import BlobStore
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.backends import empty_tables
from tests.servers import running_server

BACKENDS = ("embedded", "http", "http-postgres-s3")
#: The PostgreSQL + S3 server is the slowest to set up for each test and repeats what the other
#: two check; the engine's own PostgreSQL and S3 suites (tests/service) still run day to day.
_BACKEND_PARAMS = [
    pytest.param(name, marks=pytest.mark.slow) if name == "http-postgres-s3" else name for name in BACKENDS
]


@dataclass
class Backend:
    """A client and, behind it, the blob store that holds its shards."""

    name: str
    client: client.Client
    blobs: BlobStore


def _server_settings(request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    if request.param == "http":
        return Settings(home=home)
    endpoint = request.getfixturevalue("s3_endpoint")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    url = request.getfixturevalue("pg_url")
    database = Database(url)
    empty_tables(database)
    database.dispose()
    return Settings(home=home, database_url=url, blobs=f"s3://{bucket}/ckpt")


@pytest.fixture(params=_BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    """A client on an empty store of each kind."""
    if request.param == "embedded":
        with client.Client(home=tmp_path / "store") as embedded:
            yield Backend("embedded", embedded, embedded.transport.blobs)  # type: ignore[attr-defined]
        return
    settings = _server_settings(request, tmp_path / "server", monkeypatch)
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings)) as url, client.Client(url) as remote:
            yield Backend(request.param, remote, store.blobs)
    finally:
        store.close()


@pytest.fixture
def ckpt(backend: Backend) -> client.Client:
    """The client of the current backend."""
    return backend.client
