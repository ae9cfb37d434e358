"""Many writers on one embedded home: separate Store instances, threads and processes.

Every writer opens its own Store on a home that does not exist yet (so schema creation races
too), ingests one shard every writer shares and one of its own, then commits to the same run.
Version numbers must come out gap-free and unique, each version's parent the one before it.
"""

from __future__ import annotations

import multiprocessing
import queue
import sqlite3
import threading
from pathlib import Path

import pytest
from shardkit import body, build_shard, entry, raw

from ckptstore.service.db import session
from ckptstore.service.db.session import Database
from ckptstore.service.store import Store

RUN = "shared-run"
SHARED_SEED = 10_000


def write_versions(home: str, writer: int, commits: int, barrier: threading.Barrier | None = None) -> list[int]:
    """Open a store on ``home``, ingest this writer's shards and commit ``commits`` versions."""
    shared = raw("F32", (64,), SHARED_SEED)
    own = raw("F32", (16,), writer)
    store = Store.open_home(home)
    try:
        if barrier is not None:
            barrier.wait()
        for tensor in (shared, own):
            store.ingest_file(build_shard([tensor]).write(store.staging_path()))
        numbers = []
        for index in range(commits):
            manifest = body(
                entry("model/shared", shared, trainable=False),
                entry("model/own", own),
                step=writer * 1000 + index,
            )
            numbers.append(store.commit(RUN, manifest).version)
        return numbers
    finally:
        store.close()


def check_history(home: Path, writers: int, commits: int, numbers: list[int]) -> None:
    total = writers * commits
    assert sorted(numbers) == list(range(1, total + 1))
    store = Store.open_home(home)
    try:
        versions = store.versions(RUN)
        assert [v.version for v in versions] == list(range(1, total + 1))
        assert [v.parent for v in versions] == [None, *range(1, total)]
        assert sorted(v.step for v in versions) == sorted(w * 1000 + i for w in range(writers) for i in range(commits))
        # Each writer's own tensor is new exactly once, the shared one exactly once overall.
        assert sum(v.tensors_new for v in versions) == writers + 1
        [run] = store.runs()
        assert (run.versions, run.latest_version) == (total, total)
        shared = raw("F32", (64,), SHARED_SEED)
        expected_shards = {build_shard([shared]).shard_id} | {
            build_shard([raw("F32", (16,), w)]).shard_id for w in range(writers)
        }
        assert set(store.blobs.list_ids()) == expected_shards
        assert [p for p in store.staging_dir.iterdir()] == []
    finally:
        store.close()


def test_threads_with_separate_stores_number_versions_without_gaps(tmp_path: Path) -> None:
    writers, commits = 8, 8
    home = tmp_path / "home"
    barrier = threading.Barrier(writers)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(writer: int) -> None:
        try:
            results[writer] = write_versions(str(home), writer, commits, barrier)
        except BaseException as exc:  # reported below; a thread's exception is otherwise lost
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert sorted(results) == list(range(writers))
    for numbers in results.values():
        assert numbers == sorted(numbers)  # one writer's commits are numbered in its own order
    check_history(home, writers, commits, [n for numbers in results.values() for n in numbers])


def process_writer(home: str, writer: int, commits: int, barrier: threading.Barrier, out: queue.Queue) -> None:
    """Child process body: report this writer's version numbers, or the error it hit."""
    try:
        out.put((writer, write_versions(home, writer, commits, barrier), None))
    except BaseException as exc:
        out.put((writer, [], f"{type(exc).__name__}: {exc}"))
        raise


@pytest.mark.slow  # several processes, each importing the engine
def test_processes_number_versions_without_gaps(tmp_path: Path) -> None:
    writers, commits = 4, 10
    home = tmp_path / "home"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(writers)
    out = context.Queue()
    processes = [
        context.Process(target=process_writer, args=(str(home), w, commits, barrier, out)) for w in range(writers)
    ]
    for process in processes:
        process.start()
    reports = []
    while len(reports) < writers:
        try:
            reports.append(out.get(timeout=5))
        except queue.Empty:
            if not any(process.is_alive() for process in processes):
                break  # a child died without reporting; the exit codes below say which
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0] * writers
    assert [error for _, _, error in reports] == [None] * writers
    assert sorted(writer for writer, _, _ in reports) == list(range(writers))
    check_history(home, writers, commits, [n for _, numbers, _ in reports for n in numbers])


def test_a_fresh_file_another_connection_holds_goes_to_wal_once_it_lets_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite refuses the switch to WAL at once, busy timeout or not, while another connection
    # holds a write lock: the opener retries after a pause (here, the other one commits then).
    path = tmp_path / "store.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        if not pauses:
            holder.execute("COMMIT")
        pauses.append(seconds)

    monkeypatch.setattr(session, "sleep", pause)
    database = Database(f"sqlite:///{path}")
    try:
        with database.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        database.dispose()
        holder.close()
    assert len(pauses) == 1
