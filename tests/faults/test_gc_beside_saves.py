"""A save never fails because garbage collection ran, whatever the grace.

A save holds what the store told it is present and what it stored until it commits
(service/db/holds.py), so a collection with no grace at all, run at any moment beside it, takes
nothing the save relies on: the commit is never refused for missing tensors and nothing is sent
twice. A save that dies stops renewing its lease, and its uploads then go with the next
collection.

- saving processes beside a process collecting with grace 0 in a loop, on an embedded SQLite
  store and on PostgreSQL: every save succeeds at its first commit, every version loads bit for
  bit, and no hold is left once they are done;
- a collection with grace 0 run exactly between a save's questions and its commit (hooked onto
  the commit, no timing), with the version that referenced what the save was told is present
  deleted just before: in process, over a real uvicorn server, and for a sharded save
  (``StoreWriter``) whose ranks stored the chunks the coordinator commits;
- a save process killed after storing its tensors, before its commit: its uploads stay while
  its lease runs, and the first collection after the lease frees them all.
"""

from __future__ import annotations

import multiprocessing
import queue
import re
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database, schema
from ckptstore.service.db.holds import SAVE_LEASE_SECONDS
from ckptstore.service.db.models import SaveHold, SaveLease, utcnow
from ckptstore.service.format.names import COMMIT_KEY_PATTERN
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import PostgresDatabases
from tests.faults.gc_savers import VERSIONS, Adapted, fingerprints, saver, stored_then_killed
from tests.servers import running_server

SAVERS = 4
#: Bound on any wait for a child process: far above what its work takes.
CHILD_SECONDS = 120


# -- the tests -------------------------------------------------------------------------------


def run_beside_collection(where: dict[str, str], store: Store) -> tuple[list[Any], int]:
    """Run :data:`SAVERS` saving processes while this process collects on ``store`` with grace 0 in
    a loop until they are done; their reports and how many collections ran."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    savers = [context.Process(target=saver, args=(where, index, out)) for index in range(SAVERS)]
    for process in savers:
        process.start()
    reports: list[Any] = []
    collections = 0
    deadline = time.monotonic() + CHILD_SECONDS
    while len(reports) < SAVERS and time.monotonic() < deadline:
        store.gc(grace_seconds=0)
        collections += 1
        try:
            while True:
                reports.append(out.get_nowait())
        except queue.Empty:
            pass
        if not any(process.is_alive() for process in savers) and out.empty():
            break  # one died without reporting: its exit code says so below
    for process in savers:
        process.join(timeout=CHILD_SECONDS)
    assert [p.exitcode for p in savers] == [0] * SAVERS
    return reports, collections


def check_saves(reports: list[Any], store: Store, ckpt: client.Client, collections: int) -> None:
    """Every save succeeded at its first commit; every version loads bit for bit; nothing is held."""
    assert collections >= 2  # the collector ran beside the saves, more than once
    assert sorted(index for _, index, *_ in reports) == list(range(SAVERS))
    for _, index, errors, refused, versions in reports:
        assert errors == []
        assert refused == 0  # no commit was refused: no save had to send anything again
        assert sorted(versions) == list(range(1, VERSIONS + 1))
        for version, expected in versions.items():
            loaded = ckpt.load(f"saver-{index}", version).state_dict
            assert loaded is not None
            assert fingerprints(loaded) == expected
    with store.db.transaction() as session:  # every commit released its save's holds
        assert session.scalar(select(func.count()).select_from(SaveHold)) == 0
        assert session.scalar(select(func.count()).select_from(SaveLease)) == 0


@pytest.mark.slow  # processes, each importing torch
def test_saving_processes_beside_a_collection_with_no_grace_on_sqlite(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with closing(Store.open_home(home)) as store:  # the schema is made before the processes open it
        reports, collections = run_beside_collection({"home": str(home)}, store)
        with client.Client(home=home) as ckpt:
            check_saves(reports, store, ckpt, collections)


@pytest.mark.slow  # processes, each importing torch
def test_saving_processes_beside_a_collection_with_no_grace_on_postgresql(
    tmp_path: Path, postgres_databases: PostgresDatabases, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres_databases.create()
    database = Database(url)
    schema.upgrade(database)
    blobs = LocalBlobStore(tmp_path / "blobs")
    where = {"CKPTSTORE_DATABASE_URL": url, "CKPTSTORE_BLOBS": blobs.location, "CKPTSTORE_HOME": str(tmp_path)}
    store = Store(database, blobs, tmp_path / "staging")
    try:
        reports, collections = run_beside_collection(where, store)
        for name, value in where.items():
            monkeypatch.setenv(name, value)
        with client.Client() as ckpt:
            check_saves(reports, store, ckpt, collections)
    finally:
        store.close()


@contextmanager
def sweeping_before_commit(ckpt: client.Client, store: Store, delete: tuple[str, int]) -> Iterator[dict[str, Any]]:
    """Hook ``ckpt``'s commits: before each, delete version ``delete`` and collect with grace 0 on
    ``store``. Yields what happened: commits sent, shards stored after the collection, the
    collection's report, the digests the save was told are present."""
    seen: dict[str, Any] = {"commits": 0, "stored_after": 0, "report": None, "present": set()}
    transport = ckpt.transport
    real_commit, real_missing = transport.commit, transport.missing
    real_put_shard, real_put_tensors = transport.put_shard, transport.put_tensors

    def missing(digests: Any, **kwargs: Any) -> list[str]:
        asked = list(digests)
        absent = real_missing(asked, **kwargs)
        seen["present"] |= set(asked) - set(absent)
        return absent

    def commit(*args: Any, **kwargs: Any) -> Any:
        seen["commits"] += 1
        if seen["report"] is None:
            store.delete_version(*delete)
            seen["report"] = store.gc(grace_seconds=0)
        return real_commit(*args, **kwargs)

    def stored_after(real: Callable[..., Any]) -> Callable[..., Any]:
        def put(*args: Any, **kwargs: Any) -> Any:
            seen["stored_after"] += seen["report"] is not None
            return real(*args, **kwargs)

        return put

    transport.commit, transport.missing = commit, missing  # type: ignore[method-assign]
    transport.put_shard, transport.put_tensors = stored_after(real_put_shard), stored_after(real_put_tensors)  # type: ignore[method-assign]
    yield seen


def check_swept_beside(seen: dict[str, Any], base_digests: set[str]) -> None:
    """The save was told the base is present, the collection swept something, and the save
    committed once without sending anything again."""
    assert base_digests <= seen["present"]  # told present: then only the deleted version referenced it
    assert seen["report"].shards_swept >= 1  # the deleted version's own adapter went
    assert seen["commits"] == 1
    assert seen["stored_after"] == 0


def base_digests(ckpt: client.Client, run: str) -> set[str]:
    """The digests of the frozen base's tensors in ``run``'s latest version."""
    manifest = ckpt.transport.manifest(run, "latest")
    return {e.digest for e in manifest.tensors if e.key.startswith("model/base.") and e.digest is not None}


def test_a_collection_between_a_saves_questions_and_its_commit_takes_nothing_it_relies_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with client.Client(home=home, hash_cache=False) as first:
        first.save("first", Adapted(seed=1))
        base = base_digests(first, "first")
    # A fresh client asks about every tensor: the base is reported present (run first holds it).
    with client.Client(home=home, hash_cache=False) as ckpt, closing(Store.open_home(home)) as store:
        model = Adapted(seed=2)
        with sweeping_before_commit(ckpt, store, ("first", 1)) as seen:
            result = ckpt.save("second", model)
        check_swept_beside(seen, base)
        loaded = ckpt.load("second", result.version).state_dict
        assert loaded is not None and fingerprints(loaded) == fingerprints(model.state_dict())
        assert store.gc(grace_seconds=0).shards_swept == 0  # the commit's references keep it all now


def test_over_http_a_collection_before_the_commit_takes_nothing_the_save_relies_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    try:
        with running_server(create_app(store, Settings(home=home))) as url:
            with client.Client(url=url, hash_cache=False) as first:
                first.save("first", Adapted(seed=1))
                base = base_digests(first, "first")
            with client.Client(url=url, hash_cache=False) as ckpt:
                model = Adapted(seed=2)
                with sweeping_before_commit(ckpt, store, ("first", 1)) as seen:
                    result = ckpt.save("second", model)
                check_swept_beside(seen, base)
                loaded = ckpt.load("second", result.version).state_dict
                assert loaded is not None and fingerprints(loaded) == fingerprints(model.state_dict())
            check_bad_save_keys(url)
    finally:
        store.close()


def check_bad_save_keys(url: str) -> None:
    """A ``Save-Key`` that is no commit key is a 400 naming it, before anything is asked or stored."""
    good = COMMIT_KEY_PATTERN

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=64))
    def refused(key: str) -> None:
        if re.fullmatch(good, key):
            return
        with httpx.Client(base_url=url) as http:
            answer = http.post("/v1/tensors/missing", json={"digests": ["0" * 64]}, headers={"Save-Key": key})
            assert answer.status_code == 400, answer.text
            assert answer.json()["code"] == "invalid_name" and "commit key" in answer.json()["message"]
            upload = http.post("/v1/shards", content=b"\0" * 8, headers={"Save-Key": key})
            assert upload.status_code == 400, upload.text

    refused()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves without a group
def test_a_sharded_saves_chunks_stay_until_the_coordinator_commits(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.client.distributed import StoreWriter

    home = tmp_path / "home"
    with client.Client(home=home, hash_cache=False) as first:
        first.save("first", Adapted(seed=1))
    with client.Client(home=home, hash_cache=False) as ckpt, closing(Store.open_home(home)) as store:
        model = Adapted(seed=2)
        state = {"model": model.state_dict()}
        with sweeping_before_commit(ckpt, store, ("first", 1)) as seen:
            dcp.save(state, storage_writer=StoreWriter("sharded", client=ckpt))
        assert seen["commits"] == 1 and seen["report"].shards_swept >= 1
        manifest = ckpt.transport.manifest("sharded", "latest")
        stored = {e.key.removeprefix("model/"): e.digest for e in manifest.tensors}
        assert set(stored) == set(model.state_dict())
        assert store.locate([d for d in stored.values() if d is not None])  # every chunk is stored


def test_a_killed_saves_uploads_stay_for_its_lease_then_go(tmp_path: Path) -> None:
    home = tmp_path / "home"
    Store.open_home(home).close()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=stored_then_killed, args=(str(home), out))
    child.start()
    try:
        assert out.get(timeout=CHILD_SECONDS) == "stored"
    except queue.Empty:
        pytest.fail("the save never reached its commit")
    finally:
        child.kill()
        child.join(timeout=CHILD_SECONDS)
    with closing(Store.open_home(home)) as store:
        uploads = set(store.blobs.list_ids())
        assert uploads  # the killed save stored its tensors, and no version references them
        kept = store.gc(grace_seconds=0)
        assert kept.shards_swept == 0 and set(store.blobs.list_ids()) == uploads
        later = utcnow() + timedelta(seconds=SAVE_LEASE_SECONDS + 1)
        freed = store.gc(grace_seconds=0, now=later)
        assert freed.shards_swept == len(uploads) and set(store.blobs.list_ids()) == set()
        with store.db.transaction() as session:  # and its holds went with the collection
            assert session.scalar(select(func.count()).select_from(SaveHold)) == 0
            assert session.scalar(select(func.count()).select_from(SaveLease)) == 0
