"""Compaction of encoded shards (:mod:`service.reclaim.encoded_compaction`), on SQLite and PostgreSQL.

The story: a fine-tune with a frozen embedding. Its first version's encoded shard holds the
frozen weights, which every later version still references, beside the first keyframes and
moments. Once the versions whose deltas decoded from those keyframes are deleted, the shard is
mostly dead, yet the frozen weights pin it whole: compaction copies them into a shard of their
own, as they are, and the old shard goes at the next sweep. A damaged payload stops it, and a
collection killed at any step loses nothing; the next one finishes the job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compression_kit import (
    BELOW,
    FROZEN,
    KILLABLE_STORE,
    a_pinned_shard,
    blob_bytes,
    keyed_digests,
    run_killed,
    shard_ids,
)

from ckptstore import client
from ckptstore.service.errors import IntegrityError
from ckptstore.service.store import Store


def test_a_shard_pinned_by_one_payload_is_compacted_and_what_lives_loads_bit_for_bit(
    store: Store, ckpt: client.Client
) -> None:
    tune, pinned = a_pinned_shard(store, ckpt)
    frozen = keyed_digests(store, "run", 3)[FROZEN]
    before = store.locate([frozen])[frozen]
    stored_before = blob_bytes(store.blobs)

    dry = ckpt.gc(grace_seconds=0, compact_below=BELOW, dry_run=True)
    assert dry.shards_compacted == 1 and pinned in shard_ids(store)
    report = ckpt.gc(grace_seconds=0, compact_below=BELOW)

    assert report.shards_compacted == 1 and report.bytes_compacted > 0
    after = store.locate([frozen])[frozen]
    assert after.shard_id != pinned
    assert (after.encoding, after.stored_nbytes, after.base) == (before.encoding, before.stored_nbytes, before.base)
    assert report.shards_swept == 1  # the old shard, unreferenced now: no grace period to wait out
    assert pinned not in shard_ids(store) and set(store.blobs.list_ids()) == shard_ids(store)
    assert stored_before - blob_bytes(store.blobs) >= report.bytes_compacted > 0
    assert tune.wrong_loads(ckpt) == {}
    assert ckpt.gc(grace_seconds=0, compact_below=BELOW).shards_compacted == 0


def test_a_damaged_payload_stops_the_compaction_and_nothing_moves(store: Store, ckpt: client.Client) -> None:
    _tune, pinned = a_pinned_shard(store, ckpt)
    frozen = keyed_digests(store, "run", 3)[FROZEN]
    location = store.locate([frozen])[frozen]
    path = store.blobs._path(pinned)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[location.offset + location.length - 100] ^= 0xFF  # inside the last frame
    path.write_bytes(bytes(data))
    shards = shard_ids(store)

    with pytest.raises(IntegrityError, match=frozen[:16]):
        ckpt.gc(grace_seconds=0, compact_below=BELOW)

    assert store.locate([frozen])[frozen] == location
    assert shard_ids(store) == shards


CHILD = (
    KILLABLE_STORE
    + """
if point == "blob-stored":  # the new shard's blob stored, its rows not moved
    store.blobs.put_file = dying(store.blobs.put_file, before=False)
elif point == "mid-transaction":  # the first row moved, not committed
    service.reclaim.compression.insert_new = dying(service.reclaim.compression.insert_new, before=False)
elif point == "before-sweep":  # rows moved and the old shard stamped, nothing swept
    service.reclaim.compaction.collect = dying(service.reclaim.compaction.collect, before=True)
else:
    raise SystemExit(f"no kill point {point}")
store.gc(grace_seconds=0, compact_below=float(os.environ["BELOW"]))
raise SystemExit(3)  # the kill point was never reached
"""
)


@pytest.mark.parametrize("point", ["blob-stored", "mid-transaction", "before-sweep"])
def test_a_compaction_killed_at_any_step_loses_nothing_and_the_next_gc_finishes_it(
    store: Store, home: Path, ckpt: client.Client, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tune, pinned = a_pinned_shard(store, ckpt)
    monkeypatch.setenv("BELOW", str(BELOW))

    run_killed(CHILD, point, 1, store, home)

    orphans = set(store.blobs.list_ids()) - shard_ids(store)
    assert len(orphans) == (0 if point == "before-sweep" else 1)
    assert pinned in shard_ids(store)  # not swept yet, whatever the point
    assert tune.wrong_loads(ckpt) == {}
    ckpt.gc(grace_seconds=0, compact_below=BELOW, orphans=True)
    assert pinned not in shard_ids(store)
    assert set(store.blobs.list_ids()) == shard_ids(store)
    assert tune.wrong_loads(ckpt) == {}
