"""Garbage collection on SQLite and PostgreSQL: what is swept, what the grace period spares, and
that no interleaving of saves, deletes and collections (compacting ones too) ever loses a committed byte.

Time is injected (``now=``, and shards aged by moving ``created_at`` back), never waited for.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from shardkit import (
    HOUR,
    BuiltShard,
    Ingest,
    RawTensor,
    age,
    body,
    build_shard,
    entry,
    raw,
    reads_back,
    shard_rows,
    soon,
)
from sqlalchemy import select

import ckptstore.service.reclaim.gc  # noqa: F401  (binds service.reclaim.gc for the name below)
from ckptstore import service
from ckptstore.service.blobs import BlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.models import StoreLock, utcnow
from ckptstore.service.errors import InvalidInputError, MissingTensorsError
from ckptstore.service.format.records import GcReport
from ckptstore.service.store import Store


def swept(report: GcReport) -> tuple[int, int, int]:
    return report.shards_swept, report.tensors_swept, report.bytes_swept


# -- what is swept ------------------------------------------------------------------------------


def test_deleting_a_version_then_gc_sweeps_exactly_its_unshared_shards(store: Store, ingest: Ingest) -> None:
    shared, only_v1, also_v1, only_v2 = (raw("F32", (16,), s) for s in range(4))
    ingest(shared)
    v1_shard, _ = ingest(only_v1, also_v1)
    ingest(only_v2)
    store.commit("run", body(entry("model/shared", shared), entry("model/a", only_v1), entry("model/b", also_v1)))
    store.commit("run", body(entry("model/shared", shared), entry("model/c", only_v2)), tags=["best"])
    store.commit("other", body(entry("model/shared", shared)))
    store.delete_version("run", 1)
    blobs_before = set(store.blobs.list_ids())

    dry = store.gc(grace_seconds=0, dry_run=True, now=soon())

    assert dry.dry_run and swept(dry) == (1, 2, len(v1_shard.data))
    assert (dry.shards_kept, dry.shards_in_grace, dry.orphan_blobs) == (2, 0, 0)
    assert set(store.blobs.list_ids()) == blobs_before  # a dry run deletes nothing
    assert reads_back(store, [only_v1, also_v1])

    report = store.gc(grace_seconds=0, now=soon())

    assert not report.dry_run and swept(report) == swept(dry) and report.shards_kept == 2
    assert set(store.blobs.list_ids()) == blobs_before - {v1_shard.shard_id} == shard_rows(store)
    assert store.missing([only_v1.digest, also_v1.digest, shared.digest]) == [only_v1.digest, also_v1.digest]
    assert reads_back(store, [shared, only_v2])  # the tagged version and the other run are intact
    assert [e.digest for e in store.manifest("run", "best").tensors] == [shared.digest, only_v2.digest]
    assert swept(store.gc(grace_seconds=0, now=soon())) == (0, 0, 0)  # nothing left to sweep


def test_a_shard_holding_one_referenced_tensor_is_kept_whole(store: Store, ingest: Ingest) -> None:
    kept, dropped = raw("F32", (8,), 1), raw("F32", (8,), 2)
    ingest(kept, dropped)
    store.commit("run", body(entry("model/k", kept), entry("model/d", dropped)))
    store.commit("run", body(entry("model/k", kept)))
    store.delete_version("run", 1)

    report = store.gc(grace_seconds=0, now=soon())

    assert swept(report) == (0, 0, 0) and report.shards_kept == 1
    assert reads_back(store, [kept, dropped])


def test_a_shard_whose_tensors_all_live_elsewhere_is_swept(store: Store, ingest: Ingest) -> None:
    # Its tensors were first recorded in other shards, so it holds no tensor rows at all.
    t, u = raw("F32", (8,), 1), raw("F32", (4,), 2)
    ingest(t)
    ingest(u)
    duplicate, _ = ingest(t, u)
    store.commit("run", body(entry("model/t", t), entry("model/u", u)))

    report = store.gc(grace_seconds=0, now=soon())

    assert swept(report) == (1, 0, len(duplicate.data)) and report.shards_kept == 2
    assert store.blobs.size(duplicate.shard_id) is None
    assert reads_back(store, [t, u])


def test_without_deletes_nothing_is_swept(store: Store, ingest: Ingest) -> None:
    tensors = [raw("F32", (8,), s) for s in range(3)]
    for tensor in tensors:
        ingest(tensor)
    store.commit("run", body(*(entry(f"model/{i}", t) for i, t in enumerate(tensors))))

    report = store.gc(grace_seconds=0, now=soon() + timedelta(days=30))

    assert swept(report) == (0, 0, 0) and report.shards_kept == 3
    assert reads_back(store, tensors)


# -- the grace period ---------------------------------------------------------------------------


def test_recent_unreferenced_shards_are_kept_until_the_grace_period_ends(store: Store, ingest: Ingest) -> None:
    shard, _ = ingest(raw("F32", (8,), 1))  # uploaded, its commit not made yet
    recorded = utcnow()

    within = store.gc(grace_seconds=HOUR, now=recorded + timedelta(minutes=59))
    assert swept(within) == (0, 0, 0) and within.shards_in_grace == 1
    assert store.blobs.size(shard.shard_id) == len(shard.data)

    after = store.gc(grace_seconds=HOUR, now=recorded + timedelta(minutes=61))
    assert swept(after) == (1, 1, len(shard.data)) and after.shards_in_grace == 0
    assert store.blobs.size(shard.shard_id) is None


def test_the_default_grace_is_one_hour(store: Store, ingest: Ingest) -> None:
    ingest(raw("F32", (8,), 1))
    assert store.gc(dry_run=True).grace_seconds == HOUR == service.reclaim.gc.DEFAULT_GRACE_SECONDS
    assert store.gc().shards_in_grace == 1


def test_a_digest_reported_present_is_kept_within_the_grace_even_if_unreferenced(store: Store, ingest: Ingest) -> None:
    seen, unseen = raw("F32", (8,), 1), raw("F32", (8,), 2)
    seen_shard, _ = ingest(seen)
    unseen_shard, _ = ingest(unseen)
    store.commit("run", body(entry("model/a", seen), entry("model/b", unseen)))
    store.delete_version("run", 1)
    age(store, [seen_shard.shard_id, unseen_shard.shard_id], 2 * HOUR)  # both old garbage now

    # A save asks; it is told it need not send `seen`, and will commit a reference to it.
    assert store.missing([seen.digest]) == []
    asked = utcnow()

    within = store.gc(grace_seconds=HOUR, now=asked + timedelta(minutes=30))
    assert swept(within) == (1, 1, len(unseen_shard.data)) and within.shards_in_grace == 1
    store.commit("run", body(entry("model/a", seen)))  # the save completes
    assert reads_back(store, [seen])

    store.delete_version("run", "latest")
    later = store.gc(grace_seconds=HOUR, now=asked + timedelta(minutes=61))
    assert swept(later) == (1, 1, len(seen_shard.data))


def test_bad_grace_periods_are_refused(store: Store) -> None:
    for bad in (-1, service.reclaim.gc.MAX_GRACE_SECONDS + 1, True):
        with pytest.raises(InvalidInputError, match="grace_seconds"):
            store.gc(grace_seconds=bad)  # type: ignore[arg-type]


# -- orphans ------------------------------------------------------------------------------------


def test_orphan_blobs_are_reported_and_deleted_only_when_asked(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (8,), 1)
    ingest(t)
    store.commit("run", body(entry("model/t", t)))
    orphan = build_shard([raw("F32", (32,), 2)])  # e.g. a sweep killed between its rows and its deletes
    store.blobs.put_file(orphan.shard_id, orphan.write(store.staging_dir / "orphan"))

    reported = store.gc(grace_seconds=0, now=soon())
    assert (reported.orphan_blobs, reported.orphan_bytes, reported.orphans_swept) == (1, len(orphan.data), 0)
    assert store.gc(grace_seconds=0, orphans=True, dry_run=True, now=soon()).orphans_swept == 0
    assert store.blobs.size(orphan.shard_id) == len(orphan.data)

    cleaned = store.gc(grace_seconds=0, orphans=True, now=soon())
    assert (cleaned.orphan_blobs, cleaned.orphans_swept) == (1, 1)
    assert list(store.blobs.list_ids()) == [build_shard([t]).shard_id]
    assert reads_back(store, [t])


def test_the_lock_row_comes_back_if_it_was_deleted(store: Store, ingest: Ingest) -> None:
    with store.db.transaction() as session:
        session.query(StoreLock).delete()
    t = raw("F32", (8,), 1)
    ingest(t)
    store.commit("run", body(entry("model/t", t)))
    assert swept(store.gc(grace_seconds=0, now=soon())) == (0, 0, 0)
    with store.db.transaction() as session:
        assert list(session.scalars(select(StoreLock.name))) == ["gc"]


# -- the two windows of a sweep, opened by hand -------------------------------------------------


@dataclass
class Garbage:
    """One old, unreferenced shard of two tensors."""

    shard: BuiltShard
    tensors: list[RawTensor]


@pytest.fixture
def garbage(store: Store, ingest: Ingest) -> Garbage:
    tensors = [raw("F32", (8,), 1), raw("F32", (8,), 2)]
    shard, _ = ingest(*tensors)
    store.commit("run", body(entry("model/a", tensors[0]), entry("model/b", tensors[1])))
    store.delete_version("run", 1)
    age(store, [shard.shard_id], 2 * HOUR)
    return Garbage(shard, tensors)


def test_a_commit_after_the_sweep_names_the_swept_tensors_and_a_resend_completes_it(
    store: Store, garbage: Garbage
) -> None:
    manifest = body(entry("model/a", garbage.tensors[0]))
    # Told present outside any grace the collector honours (grace 0), the save commits too late.
    assert store.missing([garbage.tensors[0].digest]) == []
    store.gc(grace_seconds=0, now=soon())

    with pytest.raises(MissingTensorsError) as caught:
        store.commit("run", manifest)
    assert caught.value.digests == [garbage.tensors[0].digest]

    assert store.missing([garbage.tensors[0].digest]) == [garbage.tensors[0].digest]
    store.ingest_file(garbage.shard.write(store.staging_path()))
    store.commit("run", manifest)
    assert reads_back(store, [garbage.tensors[0]])


def sweep_rows_only(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run a sweep's transaction but hold back its blob deletions; returns the shard ids held back."""
    held: list[str] = []
    monkeypatch.setattr(service.reclaim.gc, "_delete_unrecorded_blobs", lambda db, blobs, ids: held.extend(ids) or 0)
    store.gc(grace_seconds=0, now=soon())
    monkeypatch.undo()
    return held


def test_a_shard_uploaded_again_between_the_sweep_and_its_blob_deletion_keeps_its_blob(
    store: Store, garbage: Garbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = sweep_rows_only(store, monkeypatch)
    assert held == [garbage.shard.shard_id] and store.missing([t.digest for t in garbage.tensors]) != []

    receipt = store.ingest_file(garbage.shard.write(store.staging_path()))  # a save sends it again
    deleted = service.reclaim.gc._delete_unrecorded_blobs(store.db, store.blobs, held)  # the sweep goes on

    assert receipt.created and deleted == 0
    store.commit("run", body(entry("model/a", garbage.tensors[0]), entry("model/b", garbage.tensors[1])))
    assert reads_back(store, garbage.tensors)


class DeleteAfterPut(BlobStore):
    """A blob store whose put of one id lets a sweep delete that blob right after the put returns."""

    def __init__(self, inner: BlobStore, db: Database, victim: str) -> None:
        self.inner, self.db, self.victim, self.puts = inner, db, victim, 0

    def put_file(self, blob_id: str, path: Path) -> None:
        self.inner.put_file(blob_id, path)
        self.puts += 1
        if blob_id == self.victim and self.puts == 1:
            assert service.reclaim.gc._delete_unrecorded_blobs(self.db, self.inner, [blob_id]) == 1

    def size(self, blob_id: str) -> int | None:
        return self.inner.size(blob_id)

    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(blob_id, offset, buffer)

    def delete(self, blob_id: str) -> None:
        self.inner.delete(blob_id)

    def list_ids(self) -> Iterator[str]:
        return self.inner.list_ids()


def test_a_blob_deleted_between_an_uploads_put_and_its_record_is_stored_again(
    store: Store, garbage: Garbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = sweep_rows_only(store, monkeypatch)
    wrapped = DeleteAfterPut(store.blobs, store.db, held[0])
    store.blobs = store.intake.blobs = wrapped

    receipt = store.ingest_file(garbage.shard.write(store.staging_path()))

    assert receipt.created and wrapped.puts == 2  # found gone under the lock, put again
    store.commit("run", body(entry("model/a", garbage.tensors[0])))
    assert reads_back(store, garbage.tensors)


def test_a_known_shard_sent_again_records_tensors_swept_from_where_they_were_first(
    store: Store, ingest: Ingest
) -> None:
    a, b = raw("F32", (8,), 1), raw("F32", (8,), 2)
    first, _ = ingest(a)  # a's row points here
    both, _ = ingest(a, b)  # holds a's bytes too, but only b's row
    store.commit("run", body(entry("model/b", b)))
    assert swept(store.gc(grace_seconds=0, now=soon())) == (1, 1, len(first.data))
    assert store.missing([a.digest]) == [a.digest]

    receipt = store.ingest_file(both.write(store.staging_path()))  # a save of a and b sends it

    assert not receipt.created and store.missing([a.digest]) == []
    assert store.locate([a.digest])[a.digest].shard_id == both.shard_id
    store.commit("run", body(entry("model/a", a), entry("model/b", b)))
    assert reads_back(store, [a, b])


# -- a sweep waits for a commit or a "present" answer in flight (PostgreSQL: real row locks) -----


def blocked_on_a_lock(store: Store) -> bool:
    """Whether some session of this database is waiting for a lock right now."""
    with store.db.engine.connect() as connection:
        waiting = connection.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).scalar_one()
    return bool(waiting)


def pause_inside(
    store: Store, monkeypatch: pytest.MonkeyPatch, module: object, name: str, grace: int
) -> tuple[threading.Event, list[GcReport]]:
    """Make ``module.name`` pause, inside its caller's transaction, while a collection runs.

    Once the function has run, a collection starts in another thread; the paused transaction
    goes on only when the collection finished (the interlock is missing) or is seen waiting for
    a lock (the interlock works). Returns the event set when the collection is done, and its report.
    """
    paused, collected = threading.Event(), threading.Event()
    reports: list[GcReport] = []
    original = getattr(module, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        result = original(*args, **kwargs)
        paused.set()
        while not collected.wait(0.01) and not blocked_on_a_lock(store):
            pass
        return result

    def collect() -> None:
        assert paused.wait(timeout=60)
        try:
            reports.append(store.gc(grace_seconds=grace, now=soon()))
        finally:
            collected.set()

    monkeypatch.setattr(module, name, wrapper)
    threading.Thread(target=collect, daemon=True).start()
    return collected, reports


@pytest.mark.parametrize("store", ["postgresql"], indirect=True)
def test_a_sweep_waits_for_a_commit_checking_its_references(
    store: Store, garbage: Garbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.service.catalog.commit  # noqa: F401  (binds service.catalog.commit for the name below)
    from ckptstore import service

    collected, reports = pause_inside(store, monkeypatch, service.catalog.commit, "check_references", 0)
    store.commit("run", body(entry("model/a", garbage.tensors[0])))  # reuses the old, unreferenced shard
    assert collected.wait(timeout=60)

    assert swept(reports[0]) == (0, 0, 0)
    assert reads_back(store, garbage.tensors)


@pytest.mark.parametrize("store", ["postgresql"], indirect=True)
def test_a_sweep_waits_for_a_save_being_told_a_tensor_is_present(
    store: Store, garbage: Garbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.service.catalog.lookup  # noqa: F401  (binds service.catalog.lookup for the name below)
    from ckptstore import service

    collected, reports = pause_inside(store, monkeypatch, service.catalog.lookup, "_stamp_seen", HOUR)
    assert store.missing([garbage.tensors[0].digest]) == []  # the old shard is garbage, but now seen
    assert collected.wait(timeout=60)

    assert swept(reports[0]) == (0, 0, 0) and reports[0].shards_in_grace == 1
    store.commit("run", body(entry("model/a", garbage.tensors[0])))  # the save completes
    assert reads_back(store, garbage.tensors)


# -- interleavings of saves, deletes and collections --------------------------------------------


@dataclass
class Round:
    """One interleaving: two saves, a delete and a collection stepping in a random order."""

    store: Store
    number: int
    rng: random.Random
    base: list[RawTensor]
    known: dict[str, bytes]
    aged: set[str]
    grace: int = 0
    events: dict[str, threading.Event] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    free: set[str] = field(default_factory=set)
    retried: dict[str, bool] = field(default_factory=dict)
    uploaded: list[str] = field(default_factory=list)
    report: GcReport | None = None
    rows_before: set[str] = field(default_factory=set)

    def step(self, name: str, action: Callable[[], None]) -> None:
        if name not in self.free:  # wait for every step the order puts before this one
            for before in self.order[: self.order.index(name)]:
                assert self.events[before].wait(timeout=60), f"{before} never finished"
        try:
            action()
        finally:
            self.events[name].set()

    def tensor(self, salt: int) -> RawTensor:
        made = raw("F32", (self.rng.randint(1, 64),), self.number * 100 + salt)
        self.known[made.digest] = made.data
        return made

    def save(self, who: str, run_id: str, tensors: list[RawTensor]) -> None:
        manifest = body(*(entry(f"model/{i}", t) for i, t in enumerate(tensors)))
        by_digest = {t.digest: t for t in tensors}
        state: dict[str, list[str]] = {}

        def upload() -> None:
            absent = state["missing"]
            if absent:
                shard = build_shard([by_digest[d] for d in absent])
                self.uploaded.append(self.store.ingest_file(shard.write(self.store.staging_path())).shard_id)

        def ask() -> None:
            state["missing"] = self.store.missing(list(by_digest))

        def commit() -> None:
            try:
                self.store.commit(run_id, manifest)
                self.retried[who] = False
            except MissingTensorsError:  # what the client does: ask again, send, commit once more
                self.retried[who] = True
                ask()
                upload()
                self.store.commit(run_id, manifest)

        self.step(f"{who}.missing", ask)
        self.step(f"{who}.ingest", upload)
        self.step(f"{who}.commit", commit)


def run_round(
    store: Store, ingest: Ingest, number: int, base: list[RawTensor], known: dict[str, bytes], aged: set[str]
) -> Round:
    rng = random.Random(number)
    game = Round(store, number, rng, base, known, aged, grace=rng.choice([0, HOUR]))
    # Half the collections also compact (drawn apart, so the interleavings stay those of each seed).
    compact_below = random.Random(10_000 + number).choice([None, 0.9])
    # The victim: a version about to be deleted whose shard is old, with a tensor the first save
    # reuses; the other one is large, so once the victim is gone its shard is mostly dead and a
    # compacting collection moves the reused tensor while the first save relies on it.
    reused = game.tensor(1)
    dropped = raw("F32", (4096,), number * 100 + 2)
    known[dropped.digest] = dropped.data
    victim_shard, _ = ingest(reused, dropped)
    victim = store.commit("victims", body(entry("model/r", reused), entry("model/d", dropped))).version
    age(store, [victim_shard.shard_id], 2 * HOUR)
    aged.add(victim_shard.shard_id)
    first_save = [reused, game.tensor(3)]
    second_save = [*rng.sample(base, 2), game.tensor(4), game.tensor(5)]

    # A random order of all steps that keeps each thread's own order; some steps run unsynchronized.
    threads = {
        "w1": ["w1.missing", "w1.ingest", "w1.commit"],
        "w2": ["w2.missing", "w2.ingest", "w2.commit"],
        "del": ["del.delete"],
        "gc": ["gc.sweep"],
    }
    pending = {name: list(steps) for name, steps in threads.items()}
    while any(pending.values()):
        game.order.append(pending[rng.choice([n for n, s in pending.items() if s])].pop(0))
    game.free = {s for s in game.order if rng.random() < 0.3}
    game.events = {s: threading.Event() for s in game.order}

    def sweep() -> None:
        game.report = store.gc(grace_seconds=game.grace, compact_below=compact_below)

    bodies: dict[str, Callable[[], None]] = {
        "w1": lambda: game.save("w1", "writers", first_save),
        "w2": lambda: game.save("w2", "writers", second_save),
        "del": lambda: game.step("del.delete", lambda: store.delete_version("victims", victim)),
        "gc": lambda: game.step("gc.sweep", sweep),
    }
    game.rows_before = shard_rows(store)
    barrier = threading.Barrier(len(bodies))
    errors: list[BaseException] = []

    def run(action: Callable[[], None]) -> None:
        try:
            barrier.wait(timeout=60)
            action()
        except BaseException as exc:  # reported below; a thread's exception is otherwise lost
            errors.append(exc)
            for event in game.events.values():
                event.set()  # let the others finish rather than wait out their timeouts

    workers = [threading.Thread(target=run, args=(action,)) for action in bodies.values()]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers)
    assert errors == [], f"round {number} ({game.order}, free {sorted(game.free)}): {errors!r}"
    return game


def check_round(store: Store, game: Round) -> None:
    where = f"round {game.number}, grace {game.grace}, order {game.order}, free {sorted(game.free)}"
    # 1. Every committed version's every byte is there and exact.
    for run in store.runs():
        for version in store.versions(run.run_id):
            digests = [e.digest for e in store.manifest(run.run_id, version.version).tensors if e.digest]
            tensors = [RawTensor("F32", (len(game.known[d]) // 4,), game.known[d]) for d in digests]
            assert reads_back(store, tensors), f"{run.run_id}@{version.version} lost bytes in {where}"
    # 2. Every shard row has its blob.
    assert shard_rows(store) <= set(store.blobs.list_ids()), where
    assert game.report is not None
    if game.grace:
        # 3. Within the grace period nothing a save relies on is swept: no commit had to resend,
        # every shard uploaded in this round is still there, only old garbage went.
        assert game.retried == {"w1": False, "w2": False}, where
        assert set(game.uploaded) <= shard_rows(store), where
        assert game.rows_before - shard_rows(store) <= game.aged, where


@pytest.mark.slow  # 60 rounds of interleaved saves, deletes and collections (some compacting) on each database
@pytest.mark.parametrize("first", [0, 30], ids=["rounds-0-29", "rounds-30-59"])
def test_saves_deletes_and_collections_in_random_interleavings_never_lose_a_committed_byte(
    store: Store, ingest: Ingest, first: int
) -> None:
    base = [raw("F32", (16,), 1_000_000 + i) for i in range(6)]
    known = {t.digest: t.data for t in base}
    for tensor in base:
        ingest(tensor)
    store.commit("base", body(*(entry(f"model/{i}", t) for i, t in enumerate(base))), tags=["keep"])
    outcomes = {0: 0, HOUR: 0}
    compacted = 0
    aged: set[str] = set()
    for number in range(first, first + 30):
        game = run_round(store, ingest, number, base, known, aged)
        check_round(store, game)
        outcomes[game.grace] += 1
        compacted += bool(game.report and game.report.shards_compacted)
    assert min(outcomes.values()) >= 5  # both kinds of collection were exercised
    assert compacted >= 3, compacted  # and collections that moved live tensors under the saves
    # After everything, a final collection leaves exactly the referenced shards.
    store.gc(grace_seconds=0, now=soon() + timedelta(days=1))
    for run in store.runs():
        for version in store.versions(run.run_id):
            digests = [e.digest for e in store.manifest(run.run_id, version.version).tensors if e.digest]
            assert reads_back(store, [RawTensor("F32", (len(known[d]) // 4,), known[d]) for d in digests])
