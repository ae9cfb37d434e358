"""SIGKILL a process in the middle of shard compaction, at each of its steps, on SQLite and on
PostgreSQL: the version whose tensors are being moved still loads bit for bit, and the next
garbage collection finishes the job (the new shard nothing points at swept, or the retired one),
leaving one shard, its blob, and no temporary file.

The child (tests/stress/compactor.py) announces each step and waits; the driver lets it on until
the step drawn for this case, then kills it there. No timer decides where it dies.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.reclaim.cleanup import clean_staging, temp_folders
from ckptstore.service.store import Store
from tests.backends import empty_tables
from tests.service.shardkit import HOUR, RawTensor, age, body, entry, raw, reads_back, shard_rows, soon
from tests.stress.phases import COMPACTION_PHASES
from tests.stress.procs import Peer, child_env

#: One live tensor over several of the writer's buffers and one small, beside two dead ones: the
#: shard is a quarter live, so ``compact_below=0.5`` picks it.
LIVE = [raw("F32", (3 << 20,), 1), raw("F32", (100,), 2)]
DEAD = [raw("F32", (5 << 20,), 3), raw("F32", (4 << 20,), 4)]


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str | None]]:
    """The store's home folder and, for PostgreSQL, its emptied database's URL."""
    home = tmp_path / "home"
    if request.param == "sqlite":
        yield home, None
        return
    url = request.getfixturevalue("pg_url")
    database = Database(url)
    empty_tables(database)
    database.dispose()
    yield home, url


def open_store(home: Path, url: str | None) -> Store:
    if url is None:
        return Store.open_home(home, direct_writes=True)
    return Store(Database(url), LocalBlobStore(home / "blobs"), home / "staging", direct_writes=True)


def unhashed(tensor: RawTensor) -> UnhashedTensor:
    return UnhashedTensor(tensor.dtype, tensor.shape, memoryview(tensor.data))


def mostly_dead_shard(store: Store) -> str:
    """One old shard whose only referenced tensors are :data:`LIVE`, kept by the version tagged ``keep``."""
    receipt, _ = store.put_tensors([unhashed(t) for t in (*LIVE, *DEAD)])
    keys = ["model/w", "model/b", "model/old_w", "model/old_b"]
    store.commit("run", body(*(entry(k, t) for k, t in zip(keys, (*LIVE, *DEAD), strict=True))))
    store.commit("run", body(*(entry(k, t) for k, t in zip(keys, LIVE, strict=False))), tags=["keep"])
    store.delete_version("run", 1)
    age(store, [receipt.shard_id], 2 * HOUR)
    return receipt.shard_id


def compact_until(
    home: Path, url: str | None, tmp_path: Path, kill_at: str | None
) -> tuple[list[str], int, str | None]:
    """Run the compactor, killing it when it announces ``kill_at`` (None: let it finish).

    Returns the phases it announced, its exit code and its last protocol line.
    """
    seen: list[str] = []
    argv = [sys.executable, "-m", "tests.stress.compactor", str(home), *([url] if url else [])]
    (tmp_path / "tmp").mkdir(exist_ok=True)
    peer = Peer("compactor", argv, child_env(home, tmp_path / "tmp"), tmp_path / "compactor.log")

    def on_phase(phase: str) -> None:
        seen.append(phase)
        if phase == kill_at:
            peer.kill()
        else:
            peer.send("go")

    peer.on_phase = on_phase
    last = peer.next_line()
    code = peer.wait()
    peer.proc.stdin.close()  # type: ignore[union-attr]
    peer.proc.stdout.close()  # type: ignore[union-attr]
    peer._log.close()
    return seen, code, last


@pytest.mark.parametrize("kill_at", [*COMPACTION_PHASES, None], ids=[*COMPACTION_PHASES, "not-killed"])
def test_a_compaction_killed_at_any_step_loses_nothing_and_the_next_gc_finishes_it(
    backend: tuple[Path, str | None], tmp_path: Path, kill_at: str | None
) -> None:
    home, url = backend
    store = open_store(home, url)
    try:
        old = mostly_dead_shard(store)
        old_size = store.blobs.size(old)
    finally:
        store.close()

    seen, code, last = compact_until(home, url, tmp_path, kill_at)

    if kill_at is None:
        assert (code, last, seen) == (0, "done 1", list(COMPACTION_PHASES)), (tmp_path / "compactor.log").read_text()
    else:  # it died exactly there, having passed every step before
        assert code == -9 and seen == list(COMPACTION_PHASES[: COMPACTION_PHASES.index(kill_at) + 1])
    store = open_store(home, url)
    try:
        assert reads_back(store, LIVE)  # whatever step it died at, the kept version loads
        assert [e.digest for e in store.manifest("run", "keep").tensors] == [t.digest for t in LIVE]

        clean_staging(store, older_than_seconds=0)  # what the killed process was writing
        store.gc(compact_below=0.5, grace_seconds=0, now=soon())  # sweeps what it left, compacts if it must
        store.gc(grace_seconds=0, now=soon())  # sweeps the shard retired just now

        (new,) = shard_rows(store)
        assert new != old and sorted(store.blobs.list_ids()) == [new]
        assert old_size is not None and (store.blobs.size(new) or 0) < old_size / 2
        assert reads_back(store, LIVE)
        assert store.missing([t.digest for t in DEAD]) == [t.digest for t in DEAD]
        assert [left for folder in temp_folders(store) if folder.exists() for left in folder.iterdir()] == []
    finally:
        store.close()
