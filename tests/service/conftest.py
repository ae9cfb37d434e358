"""Fixtures for the engine tests: an embedded store in a temporary home and a shard ingester."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from shardkit import BuiltShard, Ingest, RawTensor, build_shard

from service.records import ShardReceipt
from service.store import Store


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The embedded store's folder."""
    return tmp_path / "home"


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    """An embedded store (SQLite and local blobs) in a fresh folder."""
    opened = Store.open_home(home)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def ingest(store: Store) -> Ingest:
    """Build a shard of the given tensors, write it to staging and ingest it."""

    def run(*tensors: RawTensor) -> tuple[BuiltShard, ShardReceipt]:
        shard = build_shard(tensors)
        receipt = store.ingest_file(shard.write(store.staging_path()))
        return shard, receipt

    return run
