"""Concurrent commits over HTTP on PostgreSQL: one server, then two replicas over one database.

Fifty threads, released together by a barrier, each commit one version of the same run through
the client's HttpTransport. The versions must come out numbered 1..50 with no gap or repeat,
each the child of the one before, whichever server took the commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.format.manifest import validate_body
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, WRITE_TOKEN, Served, build_shard, commit_body, entry, tensor
from tests.backends import empty_tables

COMMITS = 50
RUN = "concurrent-run"
SHARD = build_shard(tensor(1, "F32", (8, 8)), tensor(2, "F32", (8,)))


@pytest.fixture
def pg_stores(pg_url: str, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """Make stores on the session's PostgreSQL database (emptied first) sharing one blob folder."""
    first = Database(pg_url)
    empty_tables(first)
    first.dispose()
    opened: list[Store] = []

    def open_one() -> Store:
        store = Store(Database(pg_url), LocalBlobStore(tmp_path / "blobs"), tmp_path / f"staging-{len(opened)}")
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def server_settings(pg_url: str, tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, database_url=pg_url, blobs=(tmp_path / "blobs").as_uri(), tokens=TOKENS)


def commit_concurrently(urls: list[str]) -> list[tuple[str, VersionInfo]]:
    """Upload the shard, then commit COMMITS versions at once, thread i through urls[i % len(urls)].

    Returns (server url, version info) per commit; a thread's exception fails the test.
    """
    uploader = HttpTransport(urls[0], WRITE_TOKEN)
    try:
        header, tensors = SHARD.data[: SHARD.header_length], memoryview(SHARD.data)[SHARD.header_length :]
        assert uploader.put_shard(header, [tensors]).shard_id == SHARD.shard_id
    finally:
        uploader.close()
    a, b = SHARD.tensors
    barrier = threading.Barrier(COMMITS, timeout=60)
    results: list[tuple[str, VersionInfo]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def commit(index: int) -> None:
        url = urls[index % len(urls)]
        transport = HttpTransport(url, WRITE_TOKEN, retries=0)
        try:
            body = validate_body(commit_body(entry("model/a", a), entry("extra/b", b), step=index)["manifest"])
            barrier.wait()
            info = transport.commit(RUN, body)
            with lock:
                results.append((url, info))
        except BaseException as exc:  # reported by the test, not lost in the thread
            with lock:
                failures.append(exc)
        finally:
            transport.close()

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(COMMITS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    return results


def check_chain(results: list[tuple[str, VersionInfo]]) -> None:
    """Versions 1..COMMITS, each commit exactly once, each the child of the one before."""
    infos = sorted((info for _, info in results), key=lambda info: info.version)
    assert [i.version for i in infos] == list(range(1, COMMITS + 1))
    assert [i.parent for i in infos] == [None, *range(1, COMMITS)]
    assert sorted(i.step for i in infos if i.step is not None) == list(range(COMMITS))
    # The first commit stored the tensors' bytes as new; every later one reuses them.
    assert [i.tensors_new for i in infos] == [2] + [0] * (COMMITS - 1)


def test_fifty_concurrent_commits_are_numbered_1_to_50(
    pg_stores: Callable[[], Store], pg_url: str, tmp_path: Path, serve: Callable[..., Served]
) -> None:
    server = serve(create_app(pg_stores(), server_settings(pg_url, tmp_path)))
    results = commit_concurrently([server.url])
    check_chain(results)


def test_two_replicas_on_one_database_number_50_commits_without_gaps(
    pg_stores: Callable[[], Store], pg_url: str, tmp_path: Path, serve: Callable[..., Served]
) -> None:
    settings = server_settings(pg_url, tmp_path)
    one = serve(create_app(pg_stores(), settings))
    two = serve(create_app(pg_stores(), settings))
    results = commit_concurrently([one.url, two.url])
    check_chain(results)
    by_server = {url: sum(1 for u, _ in results if u == url) for url in (one.url, two.url)}
    assert by_server == {one.url: COMMITS // 2, two.url: COMMITS // 2}
    # Each replica sees the whole history, whichever one wrote it.
    for url in (one.url, two.url):
        reader = HttpTransport(url, WRITE_TOKEN)
        try:
            assert [v.version for v in reader.versions(RUN)] == list(range(1, COMMITS + 1))
        finally:
            reader.close()
