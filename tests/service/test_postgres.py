"""The engine on PostgreSQL (READ COMMITTED) with many writers at once.

Every store operation of test_store.py also runs on PostgreSQL through the parametrized
``store`` fixture; these tests add what only concurrency shows. Each writer is a thread with its
own Store and engine, like separate service replicas sharing one database and one blob folder;
a barrier releases them together. Each test gets a brand-new database.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from shardkit import body, build_shard, entry, raw

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database, schema
from ckptstore.service.store import Store

T = TypeVar("T")


@pytest.fixture
def url(postgres_databases: Any) -> str:
    """A brand-new PostgreSQL database at the newest schema."""
    created: str = postgres_databases.create()
    database = Database(created)
    try:
        schema.upgrade(database)
    finally:
        database.dispose()
    return created


def open_store(url: str, home: Path) -> Store:
    """A store on ``url`` with blobs and staging under ``home`` (shared by every writer)."""
    return Store(Database(url), LocalBlobStore(home / "blobs"), home / "staging")


@pytest.fixture
def reader(url: str, tmp_path: Path) -> Iterator[Store]:
    """A store to set up and inspect with, outside the concurrent writers."""
    store = open_store(url, tmp_path / "home")
    try:
        yield store
    finally:
        store.close()


def all_at_once(url: str, home: Path, writers: int, work: Callable[[Store, int], T]) -> list[T]:
    """Run ``work(store, writer)`` for each writer in its own thread with its own Store, released together."""
    barrier = threading.Barrier(writers)

    def writer(index: int) -> T:
        store = open_store(url, home)
        try:
            store.runs()  # connect now, so the barrier releases writers, not connection setups
            barrier.wait(timeout=120)
            return work(store, index)
        finally:
            store.close()

    with ThreadPoolExecutor(max_workers=writers) as pool:
        futures = [pool.submit(writer, index) for index in range(writers)]
        return [future.result(timeout=300) for future in futures]


@pytest.mark.slow  # fifty concurrent commits
def test_fifty_concurrent_commits_to_a_new_run_are_numbered_without_gaps(
    url: str, reader: Store, tmp_path: Path
) -> None:
    writers = 50
    weight = raw("F32", (8,), 1)
    reader.ingest_file(build_shard([weight]).write(reader.staging_path()))

    infos = all_at_once(
        url, tmp_path / "home", writers, lambda store, i: store.commit("shared", body(entry("model/w", weight), step=i))
    )

    assert sorted(info.version for info in infos) == list(range(1, writers + 1))
    assert all(info.parent == (info.version - 1 or None) for info in infos)
    versions = reader.versions("shared")
    assert [(v.version, v.parent) for v in versions] == [(n, n - 1 or None) for n in range(1, writers + 1)]
    assert sorted(v.step for v in versions) == list(range(writers))
    assert {v.step: v.version for v in versions} == {info.step: info.version for info in infos}
    assert sum(v.tensors_new for v in versions) == 1  # same run, serialized: the weight is new once
    [run] = reader.runs()
    assert (run.run_id, run.versions, run.latest_version) == ("shared", writers, writers)
    assert reader.manifest("shared").version == writers


def test_concurrent_first_commits_and_ingests_of_the_same_shard_all_succeed(
    url: str, reader: Store, tmp_path: Path
) -> None:
    writers = 12
    a, b = raw("F32", (16,), 1), raw("BF16", (4, 4), 2)
    common = build_shard([a, b])
    # Every writer's own shard also holds a and b, in an order that differs between writers, so
    # the same tensor rows are inserted by many transactions at once.
    own = [raw("F32", (3,), 100 + i) for i in range(writers)]
    mine = [build_shard([own[i], a, b] if i % 2 else [b, own[i], a]) for i in range(writers)]

    def work(store: Store, i: int) -> tuple[bool, bool, int, int | None]:
        same = store.ingest_file(common.write(store.staging_path()))
        assert same.shard_id == common.shard_id
        private = store.ingest_file(mine[i].write(store.staging_path()))
        manifest = body(entry("model/a", a), entry("model/b", b), entry("model/own", own[i]), step=i)
        info = store.commit(f"run-{i}", manifest, tags=["first"])
        return same.created, private.created, info.version, info.parent

    results = all_at_once(url, tmp_path / "home", writers, work)

    assert sum(created for created, _, _, _ in results) == 1  # the common shard is recorded once
    assert all(private for _, private, _, _ in results)
    assert [(version, parent) for _, _, version, parent in results] == [(1, None)] * writers
    assert sorted(run.run_id for run in reader.runs()) == sorted(f"run-{i}" for i in range(writers))
    for i in range(writers):
        [version] = reader.versions(f"run-{i}")
        assert (version.version, version.tags, version.step) == (1, ["first"], i)
    everything = [a.digest, b.digest, *(t.digest for t in own)]
    assert reader.missing(everything) == []
    assert set(reader.blobs.list_ids()) == {common.shard_id, *(shard.shard_id for shard in mine)}
    assert list(reader.staging_dir.iterdir()) == []
    locations = reader.locate(everything)
    for tensor in (a, b, *own):
        where = locations[tensor.digest]
        buffer = bytearray(where.nbytes)
        reader.read_into(where.shard_id, where.offset, memoryview(buffer))
        assert bytes(buffer) == tensor.data
    # Tensor rows go in digest order, so the ingest that recorded one of a and b recorded both.
    assert locations[a.digest].shard_id == locations[b.digest].shard_id
