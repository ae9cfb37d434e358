"""Retention policies: the rules on plain numbers, then in the store on SQLite and PostgreSQL,
then many writers committing at once under a policy."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit import Ingest, body, build_shard, entry, raw
from sqlalchemy import func, select

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.catalog.retention_rules import MAX_KEEP, Policy, check_policy, keep_reasons, versions_to_remove
from ckptstore.service.db import Database, schema
from ckptstore.service.db.models import ManifestPart, Run, Version
from ckptstore.service.db.models import RetentionPolicy as PolicyRow
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

RUN = "run"


def metrics_of(values: dict[int, float | None], name: str = "loss") -> dict[int, dict[str, Any]]:
    """Versions -> metrics, with no metric at all where the value is None."""
    return {v: ({} if x is None else {name: x}) for v, x in values.items()}


# -- the rules on plain data ------------------------------------------------------------------


def test_no_rule_removes_nothing() -> None:
    versions = metrics_of({v: float(v) for v in range(1, 21)})
    assert versions_to_remove(Policy(), versions, set()) == []
    assert keep_reasons(Policy(), versions, set()) == {v: [] for v in range(1, 21)}
    assert versions_to_remove(Policy(keep_last=1), {}, set()) == []


def test_keep_last_keeps_the_newest_existing_versions() -> None:
    versions = metrics_of(dict.fromkeys(range(1, 11)))
    assert versions_to_remove(Policy(keep_last=3), versions, set()) == [1, 2, 3, 4, 5, 6, 7]
    assert versions_to_remove(Policy(keep_last=10), versions, set()) == []
    assert versions_to_remove(Policy(keep_last=MAX_KEEP), versions, set()) == []
    # Numbers left by deleted versions do not count: the last 2 are the last 2 that exist.
    gappy = metrics_of(dict.fromkeys([2, 5, 9, 30]))
    assert versions_to_remove(Policy(keep_last=2), gappy, set()) == [2, 5]


@pytest.mark.parametrize(
    ("mode", "kept"),
    [("min", [3, 6]), ("max", [1, 5])],
)
def test_keep_best_ranks_by_the_metric_lowest_or_highest(mode: str, kept: list[int]) -> None:
    versions = metrics_of({1: 9.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 8.0, 6: 1.0, 7: 2.0})
    policy = check_policy(keep_best=2, metric="loss", mode=mode)
    removed = versions_to_remove(policy, versions, set())
    assert sorted(set(versions) - set(removed)) == sorted({*kept, 7})  # 7: the newest is always kept


def test_ties_in_the_metric_go_to_the_newer_version() -> None:
    versions = metrics_of({1: 1.0, 2: 1.0, 3: 5.0, 4: 1.0, 5: 5.0, 6: 1.0, 7: 9.0})
    reasons = keep_reasons(Policy(keep_best=2, metric="loss", mode="min"), versions, set())
    assert [v for v, why in reasons.items() if "best" in why] == [4, 6]
    reasons = keep_reasons(Policy(keep_best=3, metric="loss", mode="max"), versions, set())
    assert [v for v, why in reasons.items() if "best" in why] == [3, 5, 7]
    # -0.0 and 0.0 are the same value: the newer one wins.
    zeros = {1: {"loss": 0.0}, 2: {"loss": -0.0}, 3: {"loss": 1.0}}
    assert versions_to_remove(Policy(keep_best=1, metric="loss", mode="min"), zeros, set()) == [1]


def test_versions_without_the_metric_are_never_among_the_best() -> None:
    versions = {
        1: {"loss": 3.0},
        2: {"acc": 0.9},  # another metric only
        3: {},
        4: {"loss": float("nan")},  # not a number: as if absent
        5: {"loss": True},  # a bool is not a metric value
        6: {"loss": 2.0},
        7: {},  # the newest, without the metric: kept as the newest
    }
    policy = Policy(keep_best=5, metric="loss", mode="min")
    assert versions_to_remove(policy, versions, set()) == [2, 3, 4, 5]
    assert keep_reasons(policy, versions, set())[7] == ["newest"]
    # keep_last covers a new version without the metric the same way it covers any other.
    assert versions_to_remove(Policy(keep_last=2, keep_best=1, metric="loss", mode="min"), versions, set()) == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_a_version_is_kept_by_any_rule_and_tags_always_protect() -> None:
    versions = metrics_of({1: 0.1, 2: 5.0, 3: 4.0, 4: 6.0, 5: 0.2, 6: 7.0, 7: 8.0, 8: 9.0})
    policy = Policy(keep_last=2, keep_best=2, metric="loss", mode="min")
    reasons = keep_reasons(policy, versions, {3, 7})
    assert reasons == {
        1: ["best"],
        2: [],
        3: ["tagged"],
        4: [],
        5: ["best"],
        6: [],
        7: ["last", "tagged"],
        8: ["last", "newest"],
    }
    assert versions_to_remove(policy, versions, [3, 7, 3, 99]) == [2, 4, 6]  # duplicates, unknown: ignored


def test_check_policy_validates_and_defaults_the_mode() -> None:
    assert check_policy() == Policy()
    assert check_policy(keep_last=3) == Policy(keep_last=3)
    assert check_policy(keep_best=2, metric="val/loss") == Policy(None, 2, "val/loss", "min")
    assert check_policy(keep_best=2, metric="acc", mode="max").mode == "max"
    for bad in (
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_last": MAX_KEEP + 1},
        {"keep_last": True},
        {"keep_last": 2.0},
        {"keep_best": 2},  # no metric
        {"keep_best": 2, "metric": "bad metric"},
        {"keep_best": 2, "metric": "loss", "mode": "lowest"},
        {"metric": "loss"},  # a metric without keep_best
        {"keep_last": 2, "mode": "min"},
    ):
        with pytest.raises(InvalidInputError):
            check_policy(**bad)


def test_policies_describe_themselves() -> None:
    assert Policy().describe() == "none (every version is kept)"
    assert Policy(keep_last=1).describe() == "keep the last 1 version, plus every tagged version and the newest"
    both = Policy(keep_last=3, keep_best=2, metric="acc", mode="max").describe()
    assert both == "keep the last 3 versions and the best 2 by acc (highest), plus every tagged version and the newest"


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.integers(0, 6).map(float)), min_size=1, max_size=25),
    keep_last=st.one_of(st.none(), st.integers(1, 5)),
    keep_best=st.one_of(st.none(), st.integers(1, 5)),
    mode=st.sampled_from(["min", "max"]),
    tagged=st.sets(st.integers(1, 25), max_size=4),
)
def test_applying_at_every_commit_equals_applying_once_at_the_end(
    values: list[float | None], keep_last: int | None, keep_best: int | None, mode: str, tagged: set[int]
) -> None:
    policy = check_policy(keep_last, keep_best, "loss" if keep_best else None, mode if keep_best else None)
    everything = metrics_of(dict(enumerate(values, start=1)))
    present: dict[int, dict[str, Any]] = {}
    for number, metrics in everything.items():
        present[number] = metrics
        for gone in versions_to_remove(policy, present, tagged):
            del present[gone]
    once = set(everything) - set(versions_to_remove(policy, everything, tagged))
    assert set(present) == once


# -- in the store (SQLite, then PostgreSQL) ----------------------------------------------------

W = raw("F32", (4,), 1)


@pytest.fixture
def commit(store: Store, ingest: Ingest) -> Callable[..., VersionInfo]:
    """Commit a one-tensor version to RUN with the given loss (None: no metric) and tags."""
    ingest(W)

    def run(loss: float | None = None, tags: tuple[str, ...] = (), run_id: str = RUN) -> VersionInfo:
        metrics = {} if loss is None else {"loss": loss}
        return store.commit(run_id, body(entry("model/w", W), metrics=metrics), tags=tags)

    return run


def numbers(store: Store, run_id: str = RUN) -> list[int]:
    return [v.version for v in store.versions(run_id)]


def referenced_versions(store: Store, run_id: str = RUN) -> list[int]:
    with store.db.transaction() as session:
        # Each manifest part counts exactly the versions listing it: a removed version was
        # taken off its parts' counts (or garbage collection would keep its tensors forever).
        listing: Counter[int] = Counter()
        for (parts,) in session.execute(select(Version.parts)):
            listing.update(parts)
        counted = {pid: n for pid, n in session.execute(select(ManifestPart.id, ManifestPart.versions))}
        assert {pid: n for pid, n in counted.items() if n} == dict(listing)
        found = session.scalars(select(Version.version).where(Version.run_id == run_id))
        return sorted(found)


def test_a_policy_round_trips_and_previews_without_removing(store: Store, commit: Callable[..., VersionInfo]) -> None:
    for loss in (5.0, 1.0, 4.0, 3.0, 2.0):
        commit(loss)
    empty = store.get_retention(RUN)
    assert (empty.keep_last, empty.keep_best, empty.metric, empty.mode, empty.would_remove) == (
        None,
        None,
        None,
        None,
        [],
    )
    record = store.set_retention(RUN, keep_last=2, keep_best=1, metric="loss")
    assert (record.keep_last, record.keep_best, record.metric, record.mode) == (2, 1, "loss", "min")
    assert record.would_remove == [1, 3]
    assert numbers(store) == [1, 2, 3, 4, 5]  # setting removes nothing
    assert store.get_retention(RUN) == record
    assert store.get_retention(RUN).would_remove == [1, 3]

    replaced = store.set_retention(RUN, keep_best=2, metric="loss", mode="max")
    assert (replaced.keep_last, replaced.keep_best, replaced.mode, replaced.would_remove) == (None, 2, "max", [2, 4])
    cleared = store.set_retention(RUN)
    assert (cleared.keep_last, cleared.keep_best, cleared.would_remove) == (None, None, [])
    with store.db.transaction() as session:
        assert session.scalar(select(func.count()).select_from(PolicyRow)) == 0


def test_the_policy_applies_at_each_commit_and_on_demand(store: Store, commit: Callable[..., VersionInfo]) -> None:
    for loss in (5.0, 1.0, 4.0):
        commit(loss)
    store.set_retention(RUN, keep_last=1)
    assert store.apply_retention(RUN) == [1, 2]
    assert store.apply_retention(RUN) == []
    assert numbers(store) == [3]
    info = commit(2.0)
    assert (info.version, info.parent) == (4, 3)
    assert numbers(store) == [4] and referenced_versions(store) == [4]
    # Blobs stay: the removed versions' bytes are garbage collection's to reclaim.
    assert store.missing([W.digest]) == []
    assert [r.versions for r in store.runs()] == [1]


def test_tags_protect_versions_until_they_move(store: Store, commit: Callable[..., VersionInfo]) -> None:
    store.set_retention(RUN, keep_last=1, create_run=True)
    commit(tags=("pinned",))
    commit(tags=("candidate",))
    assert numbers(store) == [1, 2]
    commit(tags=("candidate",))  # the tag moves to version 3: version 2 loses its protection in this commit
    assert numbers(store) == [1, 3]
    store.tag(RUN, 3, "release")
    store.untag(RUN, "candidate")
    commit()
    assert numbers(store) == [1, 3, 4]
    store.untag(RUN, "pinned")
    assert store.get_retention(RUN).would_remove == [1]
    commit()
    assert numbers(store) == [3, 5]
    assert {v.version: v.tags for v in store.versions(RUN)} == {3: ["release"], 5: []}
    assert referenced_versions(store) == [3, 5]


def test_keep_best_alone_keeps_the_new_version_until_the_next_commit(
    store: Store, commit: Callable[..., VersionInfo]
) -> None:
    store.set_retention(RUN, keep_best=2, metric="loss", create_run=True)
    commit(3.0)
    commit(1.0)
    info = commit(None)  # no loss: not among the best, but the newest, so it stays for now
    assert numbers(store) == [1, 2, 3] and store.manifest(RUN, info.version).version == 3
    commit(2.0)  # now version 3 is neither best nor newest; version 1 (3.0) is third best
    assert numbers(store) == [2, 4]
    commit(9.0)  # newest, though worst
    assert numbers(store) == [2, 4, 5]
    commit(0.5)
    assert numbers(store) == [2, 6]


def test_policies_belong_to_one_run(store: Store, commit: Callable[..., VersionInfo]) -> None:
    store.set_retention("other", keep_last=1, create_run=True)
    for _ in range(3):
        commit()
        commit(run_id="other")
    assert numbers(store) == [1, 2, 3]
    assert numbers(store, "other") == [3]


def test_a_policy_may_come_before_the_first_commit(store: Store, commit: Callable[..., VersionInfo]) -> None:
    with pytest.raises(NotFoundError, match="run 'fresh' does not exist"):
        store.get_retention("fresh")
    with pytest.raises(NotFoundError):
        store.apply_retention("fresh")
    with pytest.raises(NotFoundError, match="run 'fresh' does not exist"):
        store.set_retention("fresh", keep_last=2)  # a mistyped run id is not made into a run
    assert store.runs() == []
    record = store.set_retention("fresh", keep_last=2, create_run=True)
    assert (record.run_id, record.keep_last, record.would_remove) == ("fresh", 2, [])
    assert [(r.run_id, r.versions) for r in store.runs()] == [("fresh", 0)]
    for _ in range(4):
        commit(run_id="fresh")
    assert numbers(store, "fresh") == [3, 4]


def test_a_bad_policy_changes_nothing(store: Store, commit: Callable[..., VersionInfo]) -> None:
    commit()
    store.set_retention(RUN, keep_last=5)
    for bad in ({"keep_last": 0}, {"keep_best": 1}, {"keep_best": 1, "metric": "loss", "mode": "best"}):
        with pytest.raises(InvalidInputError):
            store.set_retention(RUN, **bad)
        with pytest.raises(InvalidInputError):
            store.set_retention("never-made", **bad)
    assert store.get_retention(RUN).keep_last == 5
    assert [r.run_id for r in store.runs()] == [RUN]
    with pytest.raises(InvalidInputError):
        store.set_retention("../bad", keep_last=1)


# -- many writers at once ----------------------------------------------------------------------

WRITERS = 30
LOSSES = [None if w % 7 == 3 else float((w * 13) % 9) for w in range(WRITERS)]  # ties, and a few without
POLICY = {"keep_last": 3, "keep_best": 2, "metric": "loss", "mode": "min"}


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """Opens a new Store (own engine, own connections) on one shared database and blob folder."""
    home = tmp_path / "home"
    if request.param == "sqlite":
        yield lambda: Store.open_home(home)
        return
    url: str = request.getfixturevalue("postgres_databases").create()
    database = Database(url)
    schema.upgrade(database)
    database.dispose()
    yield lambda: Store(Database(url), LocalBlobStore(home / "blobs"), home / "staging")


def build_one(store: Store) -> Path:
    """Version W's shard, staged in ``store``."""
    return build_shard([W]).write(store.staging_path())


def at_once(opener: Callable[[], Store], writers: int, work: Callable[[Store, int], Any]) -> list[Any]:
    """Run ``work(store, writer)`` in a thread per writer, each with its own Store, released together."""
    barrier = threading.Barrier(writers)

    def writer(index: int) -> Any:
        store = opener()
        try:
            store.runs()  # connect first, so the barrier releases commits, not connection setups
            barrier.wait(timeout=120)
            return work(store, index)
        finally:
            store.close()

    with ThreadPoolExecutor(max_workers=writers) as pool:
        return [future.result(timeout=300) for future in [pool.submit(writer, i) for i in range(writers)]]


@pytest.mark.slow  # concurrent commits on each database
def test_concurrent_commits_leave_exactly_what_the_policy_keeps(opener: Callable[[], Store]) -> None:
    setup = opener()
    try:
        setup.ingest_file(build_one(setup))
        setup.set_retention(RUN, **POLICY, create_run=True)
    finally:
        setup.close()

    def commit_one(store: Store, writer: int) -> VersionInfo:
        loss = LOSSES[writer]
        tags = ["pinned"] if writer == 11 else ["candidate"] if writer % 5 == 0 else []
        return store.commit(RUN, body(entry("model/w", W), metrics={} if loss is None else {"loss": loss}), tags=tags)

    infos = at_once(opener, WRITERS, commit_one)

    assert sorted(i.version for i in infos) == list(range(1, WRITERS + 1))
    # What the policy says about everything committed, with the tags where they ended up: a
    # moving tag ends on the highest version that carried it (commits are numbered in order).
    tagged = {
        "pinned": next(i.version for i in infos if "pinned" in i.tags),
        "candidate": max(i.version for i in infos if "candidate" in i.tags),
    }
    policy = check_policy(**POLICY)
    everything = {i.version: dict(i.metrics) for i in infos}
    expected = sorted(set(everything) - set(versions_to_remove(policy, everything, set(tagged.values()))))
    assert len(expected) <= 3 + 2 + 2

    check = opener()
    try:
        kept = check.versions(RUN)
        assert [v.version for v in kept] == expected
        assert {tag: v.version for v in kept for tag in v.tags} == tagged
        assert referenced_versions(check) == expected
        assert check.get_retention(RUN).would_remove == []
        with check.db.transaction() as session:
            assert session.scalar(select(Run.version_counter).where(Run.id == RUN)) == WRITERS
    finally:
        check.close()


def test_tags_set_while_commits_apply_the_policy_are_never_lost(opener: Callable[[], Store]) -> None:
    """A tag set on a version just as a commit's policy would remove it: either the tag lands
    first and protects the version, or the version is gone and tagging it fails."""
    setup = opener()
    try:
        setup.ingest_file(build_one(setup))
        setup.set_retention(RUN, keep_last=1, create_run=True)
        setup.commit(RUN, body(entry("model/w", W)))
    finally:
        setup.close()
    commits = 40
    done = threading.Event()

    def work(store: Store, role: int) -> list[tuple[str, int]]:
        if role == 0:
            try:
                for _ in range(commits):
                    store.commit(RUN, body(entry("model/w", W)))
            finally:
                done.set()
            return []
        landed = []
        for attempt in range(4 * commits):  # bounded: SQLite does not queue writers fairly
            if done.is_set():
                break
            name = f"t{role}-{attempt}"
            try:
                version = store.tag(RUN, store.resolve(RUN), name)
            except NotFoundError:  # removed between resolving and tagging
                continue
            landed.append((name, version))
        return landed

    results = at_once(opener, 3, work)
    landed = [pair for found in results for pair in found]
    check = opener()
    try:
        tags = {tag: v.version for v in check.versions(RUN) for tag in v.tags}
        assert tags == dict(landed)
        assert check.versions(RUN)[-1].version == commits + 1
    finally:
        check.close()
