"""Shared test settings and real backends: no progress bars, an S3 server, PostgreSQL databases."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ckptstore.service.db import Database, schema
from tests.backends import POSTGRES_URL, PostgresDatabases, moto_server

os.environ.setdefault("CKPTSTORE_DISABLE_PROGRESS_BARS", "1")
# Stores made by tests write directly rather than measure their disk each (a quarter of a second
# per fresh store); tests/service/test_write_probe.py covers the measuring.
os.environ.setdefault("CKPTSTORE_DIRECT_WRITES", "1")
# Stores made by tests keep a small reserve of disk for cleanup (64 MiB each would add up over
# the suite's stores); tests/faults/test_full_disk.py sets its own.
os.environ.setdefault("CKPTSTORE_RESERVE_BYTES", str(1 << 20))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` where torch sees no CUDA device (their CPU and ``meta``
    counterparts run everywhere)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch  # only when such tests were collected: the service's tests need no torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto S3 server shared by the session; tests create their own buckets."""
    with moto_server(tmp_path_factory.mktemp("aws")) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_databases() -> Iterator[PostgresDatabases]:
    """Maker of fresh PostgreSQL databases, each dropped when the session ends."""
    databases = PostgresDatabases(POSTGRES_URL)
    try:
        yield databases
    finally:
        databases.drop_all()


@pytest.fixture(scope="session")
def pg_url(postgres_databases: PostgresDatabases) -> str:
    """A fresh PostgreSQL database for this session, migrated to the newest schema."""
    url = postgres_databases.create()
    database = Database(url)
    try:
        schema.upgrade(database)
    finally:
        database.dispose()
    return url
