"""Shard compaction on SQLite and PostgreSQL: a mostly dead shard's live tensors move to a new
shard, every version still loads bit for bit, and the old shard waits out the grace period.

Time is injected (``now=``, and shards aged by moving ``created_at`` back), never waited for.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

import pytest
from shardkit import Ingest, RawTensor, body, entry, raw

import ckptstore.service.reclaim.compaction  # noqa: F401  (binds service.reclaim.compaction for the name below)
from ckptstore import service
from ckptstore.service.errors import InvalidInputError, StorageError
from ckptstore.service.format.safetensors_header import ShardHeader
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.store import Store
from tests.faults.faulty import FaultyBlobStore, os_error
from tests.service.test_gc import HOUR, age, reads_back, shard_rows, soon


def blob_bytes(store: Store) -> int:
    return sum(store.blobs.size(blob_id) or 0 for blob_id in store.blobs.list_ids())


def mostly_dead(store: Store, ingest: Ingest) -> tuple[str, RawTensor, list[RawTensor]]:
    """One old shard holding a small live tensor and two large ones no version references any more."""
    live, dead = raw("F32", (64,), 1), [raw("F32", (8192,), 2), raw("F32", (8192,), 3)]
    shard, _ = ingest(live, *dead)
    store.commit("run", body(entry("model/live", live), entry("model/a", dead[0]), entry("model/b", dead[1])))
    store.commit("run", body(entry("model/live", live)), tags=["keep"])
    store.delete_version("run", 1)
    age(store, [shard.shard_id], 2 * HOUR)
    return shard.shard_id, live, dead


def test_a_mostly_dead_shard_is_compacted_and_its_old_blob_waits_out_the_grace(store: Store, ingest: Ingest) -> None:
    old, live, dead = mostly_dead(store, ingest)
    before = store.locate([live.digest])[live.digest]  # a load that located the tensor before compaction
    bytes_before = blob_bytes(store)

    report = store.gc(compact_below=0.5)

    assert report.shards_compacted == 1 and report.bytes_compacted > 0
    assert report.shards_swept == 0 and report.shards_in_grace == 1  # the retired shard
    moved = store.locate([live.digest])[live.digest]
    assert moved.shard_id != old and moved.shard_id in shard_rows(store)
    assert reads_back(store, [live])
    buffer = bytearray(before.nbytes)
    store.read_into(before.shard_id, before.offset, memoryview(buffer))  # the old location still reads
    assert bytes(buffer) == live.data
    assert [e.digest for e in store.manifest("run", "keep").tensors] == [live.digest]

    later = store.gc(grace_seconds=0, now=soon())

    assert later.shards_swept == 1 and later.tensors_swept == len(dead)
    assert old not in shard_rows(store) and store.blobs.size(old) is None
    assert blob_bytes(store) == bytes_before - report.bytes_compacted < bytes_before / 2
    assert reads_back(store, [live])
    assert store.missing([t.digest for t in dead]) == [t.digest for t in dead]


def test_a_shard_above_the_threshold_is_left_alone(store: Store, ingest: Ingest) -> None:
    live, dead = [raw("F32", (8192,), 1), raw("F32", (8192,), 2)], raw("F32", (8192,), 3)
    shard, _ = ingest(*live, dead)
    store.commit("run", body(entry("model/x", live[0]), entry("model/y", live[1]), entry("model/z", dead)))
    store.commit("run", body(entry("model/x", live[0]), entry("model/y", live[1])))
    store.delete_version("run", 1)
    age(store, [shard.shard_id], 2 * HOUR)

    report = store.gc(compact_below=0.5, grace_seconds=0, now=soon())

    assert (report.shards_compacted, report.bytes_compacted, report.shards_swept) == (0, 0, 0)
    assert shard_rows(store) == {shard.shard_id} and reads_back(store, [*live, dead])
    assert store.gc(compact_below=0.9, grace_seconds=0, now=soon()).shards_compacted == 1


def test_a_recent_shard_is_not_compacted(store: Store, ingest: Ingest) -> None:
    old, live, _dead = mostly_dead(store, ingest)
    age(store, [old], -2 * HOUR)  # back to now: inside the grace period

    assert store.gc(compact_below=0.5).shards_compacted == 0
    assert store.locate([live.digest])[live.digest].shard_id == old


def test_a_dry_run_reports_the_compaction_and_changes_nothing(store: Store, ingest: Ingest) -> None:
    old, live, _dead = mostly_dead(store, ingest)
    blobs_before, rows_before = set(store.blobs.list_ids()), shard_rows(store)

    dry = store.gc(compact_below=0.5, dry_run=True, grace_seconds=0, now=soon())

    assert dry.dry_run and dry.shards_compacted == 1 and dry.bytes_compacted > 0
    assert set(store.blobs.list_ids()) == blobs_before and shard_rows(store) == rows_before
    assert store.locate([live.digest])[live.digest].shard_id == old


def test_bad_thresholds_are_refused(store: Store) -> None:
    for bad in (0, -0.5, 1.5, True, "half"):
        with pytest.raises(InvalidInputError, match="compact_below"):
            store.gc(compact_below=bad)  # type: ignore[arg-type]


def test_a_crash_between_writing_and_repointing_loses_nothing_and_a_later_gc_cleans_up(
    store: Store, ingest: Ingest, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, live, _dead = mostly_dead(store, ingest)

    def crash(*args: object) -> bool:
        raise StorageError("the process died here")

    with monkeypatch.context() as patch:
        patch.setattr(service.reclaim.compaction, "_repoint", crash)
        with pytest.raises(StorageError, match="died"):
            store.gc(compact_below=0.5)

    assert store.locate([live.digest])[live.digest].shard_id == old and reads_back(store, [live])
    assert len(shard_rows(store)) == 2  # the new shard, recorded, nothing pointing at it
    cleanup = store.gc(grace_seconds=0, now=soon())
    assert cleanup.shards_swept == 1 and shard_rows(store) == {old} and reads_back(store, [live])
    assert store.gc(compact_below=0.5, grace_seconds=0, now=soon()).shards_compacted == 1
    assert old not in shard_rows(store) and reads_back(store, [live])


def test_a_failed_write_of_the_new_shard_leaves_the_old_one_in_use(store: Store, ingest: Ingest) -> None:
    old, live, _dead = mostly_dead(store, ingest)
    faulty = FaultyBlobStore(store.blobs)
    store.blobs = store.intake.blobs = faulty
    faulty.arm("fsync-file", os_error(errno.EIO))

    with pytest.raises(StorageError):
        store.gc(compact_below=0.5)

    assert faulty.fired == 1
    assert store.locate([live.digest])[live.digest].shard_id == old and reads_back(store, [live])
    assert store.gc(compact_below=0.5, grace_seconds=0, now=soon()).shards_compacted == 1
    assert reads_back(store, [live])


def test_a_dead_tensor_referenced_again_during_compaction_keeps_the_old_shard(
    store: Store, ingest: Ingest, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, live, dead = mostly_dead(store, ingest)
    write = store._compaction_write

    def commit_then_write(tensors: Sequence[UnhashedTensor]) -> tuple[ShardHeader, list[str]]:
        # A save told the dead tensor was present before the compaction began commits now.
        store.commit("other", body(entry("model/back", dead[0])))
        return write(tensors)

    monkeypatch.setattr(store, "_compaction_write", commit_then_write)

    report = store.gc(compact_below=0.5, grace_seconds=0, now=soon())

    assert report.shards_compacted == 0 and old in shard_rows(store)
    assert reads_back(store, [live, dead[0]])
    assert store.gc(grace_seconds=0, now=soon()).shards_swept == 0 and old in shard_rows(store)
    assert reads_back(store, [live, dead[0]])
