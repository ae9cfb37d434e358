"""A compressing collection killed at each of its steps (SIGKILL, in a subprocess running the real
pass on SQLite and on PostgreSQL) leaves every version loadable bit for bit, and the next
``gc(compress=True, orphans=True)`` finishes the job: every version visited, every large tensor
encoded, no orphan blob, no dangling delta.

The child is the real ``Store.gc`` opened from the environment as ``ckptstore gc`` opens it; the
one thing it changes is to wrap a function of the pass so that its Nth call kills the process,
before or after the call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compression_kit import (
    KILLABLE_STORE,
    LARGE_KEYS,
    WEIGHT_KEYS,
    FineTune,
    dangling_needs,
    deltas,
    large_digests,
    run_killed,
    shard_ids,
    uncompressed_versions,
)

from ckptstore import client
from ckptstore.service.store import Store

CHILD = (
    KILLABLE_STORE
    + """
if point == "shard-written":  # a shard written to the staging folder, not yet in the blob store
    store.blobs.put_file = dying(store.blobs.put_file, before=True)
elif point == "blob-stored":  # a shard's blob is in the blob store, its transaction not begun
    store.blobs.put_file = dying(store.blobs.put_file, before=False)
elif point == "mid-transaction":  # tensors moved onto the new shard, not committed
    service.reclaim.compression.insert_missing = dying(service.reclaim.compression.insert_missing, before=True)
elif point == "mid-version":  # one shard of a version recorded, the next not written
    service.reclaim.compression.SHARD_BYTES = 1
    compression = service.reclaim.compression
    compression.write_encoded_shard = dying(compression.write_encoded_shard, before=False)
elif point == "version-unmarked":  # every shard of a version recorded, the version not marked
    service.reclaim.compression._mark = dying(service.reclaim.compression._mark, before=True)
elif point == "before-compaction":  # every version compressed, the raw shards not yet compacted
    service.reclaim.compaction.compact = dying(service.reclaim.compaction.compact, before=True)
elif point == "mid-sweep":  # swept shards' rows deleted, their blobs not
    service.reclaim.gc._delete_unrecorded_blobs = dying(service.reclaim.gc._delete_unrecorded_blobs, before=True)
else:
    raise SystemExit(f"no kill point {point}")
store.gc(compress=True, grace_seconds=0)
raise SystemExit(3)  # the kill point was never reached
"""
)

#: Where the child dies, and at which call of the wrapped function.
POINTS = {
    "shard-written": 1,  # version 1's shard
    "blob-stored": 2,  # version 2's shard
    "mid-transaction": 4,  # the fourth tensor moved of version 1
    "mid-version": 3,  # the third of version 1's one-tensor shards
    "version-unmarked": 2,  # version 2
    "before-compaction": 1,
    "mid-sweep": 1,
}
VERSIONS = 3


def kill_compression_at(point: str, store: Store, home: Path) -> None:
    """Run ``gc(compress=True, grace_seconds=0)`` on the store in a child killed at ``point``."""
    run_killed(CHILD, point, POINTS[point], store, home)


def encoded_tensors(store: Store, version: int) -> int:
    """How many of the large tensors ``run@version`` holds are stored encoded."""
    digests = large_digests(store, "run", version).values()
    where = store.locate(digests)  # with the bases of deltas among them
    return sum(1 for digest in digests if where[digest].encoded)


@pytest.mark.parametrize("point", list(POINTS))
def test_a_compression_killed_at_any_step_loses_nothing_and_the_next_gc_finishes_it(
    store: Store, home: Path, ckpt: client.Client, point: str
) -> None:
    tune = FineTune(torch.bfloat16)
    for _ in range(VERSIONS):
        tune.save(ckpt, "run")

    kill_compression_at(point, store, home)

    # What the kill left: each point leaves the store part-way, as described.
    left = uncompressed_versions(store)
    orphans = set(store.blobs.list_ids()) - shard_ids(store)
    encoded = [encoded_tensors(store, version) for version in range(1, VERSIONS + 1)]
    expected = {
        "shard-written": ([("run", v) for v in (1, 2, 3)], 0, [0, 0, 0]),
        "blob-stored": ([("run", 2), ("run", 3)], 1, [len(LARGE_KEYS), 0, 0]),
        "mid-transaction": ([("run", v) for v in (1, 2, 3)], 1, [0, 0, 0]),
        "mid-version": ([("run", v) for v in (1, 2, 3)], 0, [3, 0, 0]),
        "version-unmarked": ([("run", 2), ("run", 3)], 0, [len(LARGE_KEYS), len(LARGE_KEYS), 0]),
        "before-compaction": ([], 0, [len(LARGE_KEYS)] * VERSIONS),
    }
    if point == "mid-sweep":
        assert left == [] and orphans and encoded == [len(LARGE_KEYS)] * VERSIONS
    else:
        assert (left, len(orphans), encoded) == expected[point]
    assert tune.wrong_loads(ckpt) == {}
    assert dangling_needs(store) == []

    report = ckpt.gc(compress=True, orphans=True, grace_seconds=0)

    assert uncompressed_versions(store) == []
    assert report.versions_compressed == len(left)
    # The one file a kill leaves in the staging folder, a shard not yet in the blob store, goes
    # with the orphans: nobody holds it.
    assert report.staging_files_swept == (1 if point == "shard-written" else 0)
    again = ckpt.gc(compress=True, orphans=True, grace_seconds=0)
    assert (again.versions_compressed, again.tensors_compressed, again.orphan_blobs, again.shards_swept) == (0, 0, 0, 0)
    assert set(store.blobs.list_ids()) == shard_ids(store)
    assert dangling_needs(store) == []
    assert store.clean_staging(0).removed == 0
    for version in range(1, VERSIONS + 1):
        digests = large_digests(store, "run", version)
        assert sorted(digests) == sorted(LARGE_KEYS)
        where = store.locate(digests.values())
        assert all(location.encoded for location in where.values()), version
        assert [deltas(where, digests[key]) for key in WEIGHT_KEYS] == [min(version - 1, 1)] * len(WEIGHT_KEYS)
    assert tune.wrong_loads(ckpt) == {}
