"""Fixtures for the engine tests: a store (SQLite, PostgreSQL) in a temporary home, a shard
ingester, and a client on that store. The S3 server and PostgreSQL databases come from
tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from compression_kit import open_client
from shardkit import BuiltShard, Ingest, RawTensor, build_shard

from ckptstore import client
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.store import Store
from tests.backends import empty_tables


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The embedded store's folder."""
    return tmp_path / "home"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, home: Path) -> Iterator[Store]:
    """An empty store with local blobs in a fresh folder: embedded SQLite, then PostgreSQL."""
    opened = Store.open_home(home) if request.param == "sqlite" else postgres_store(request, home)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def ckpt(
    store: Store, home: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[client.Client]:
    """A client on the ``store`` fixture's store (embedded SQLite, or PostgreSQL with local blobs)."""
    with open_client(store, home, request, monkeypatch) as opened:
        yield opened


@pytest.fixture
def ingest(store: Store) -> Ingest:
    """Build a shard of the given tensors, write it to staging and ingest it."""

    def run(*tensors: RawTensor) -> tuple[BuiltShard, ShardReceipt]:
        shard = build_shard(tensors)
        receipt = store.ingest_file(shard.write(store.staging_path()))
        return shard, receipt

    return run


def postgres_store(request: pytest.FixtureRequest, home: Path) -> Store:
    """A store on the session's PostgreSQL database, emptied, with blobs and staging under ``home``."""
    database = Database(request.getfixturevalue("pg_url"))
    empty_tables(database)
    return Store(database, LocalBlobStore(home / "blobs"), home / "staging")
