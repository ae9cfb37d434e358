"""Garbage collection: mark and sweep shards that no committed version references.

Deleting a version never deletes bytes; :func:`collect` does, later:

- **Mark.** A tensor is *referenced* when a manifest part that some committed version lists
  names its digest (``part_refs`` of a ``manifest_parts`` row whose version count is above 0;
  see :mod:`service.catalog.manifest_parts`), or when a stored delta decodes from it (``tensor_needs``,
  :mod:`service.reclaim.compression`: a sweep that removes a delta is followed by another, which may
  then remove what it decoded from). A shard is *live* while any of its tensor rows is
  referenced. Parts no version lists any more are deleted first, batch by batch under the
  exclusive lock, with their bodies and references.
- **Holds.** A shard with no referenced tensor is kept, whatever the grace, while a save in
  progress holds one of its tensors (:mod:`service.db.holds`): a save that names itself by its
  commit key holds every digest it was told is present and every tensor it stored, renews its
  lease with each call, and releases its holds when it commits. A save whose last call is
  older than the lease (``SAVE_LEASE_SECONDS``, ten minutes) is taken for dead: its holds keep
  nothing, and each collection deletes them first. So a save never fails because a collection
  ran, and ``grace_seconds=0`` still frees everything no version references and no live save
  holds.
- **Grace.** A shard with no referenced tensor is also kept while it is recent (recorded less
  than ``grace_seconds`` ago: an upload whose commit has not come yet) or while any of its
  tensors was reported present by :meth:`Store.missing` within the grace period (a save that
  was told "you need not send this" and has not committed yet: what protects the saves of
  clients that name no save).
- **Sweep.** The rest lose their tensor and shard rows in one transaction (from then on
  ``missing`` reports their tensors absent, so a save sends them again); their blobs are
  deleted after that transaction commits.

The interlock. Every transaction that can make a shard or tensor needed — ``missing`` (which
stamps ``last_seen_at`` and holds), a shard's recording (which holds), a commit — first takes the ``store_locks`` row
``gc`` in share mode (``SELECT … FOR SHARE``). The sweep works in batches of shards: a first
look without the lock picks candidates, then each batch is marked again and its rows deleted in
a transaction holding the row exclusively (``FOR UPDATE``). So a commit either finished before
that mark (its references protect its tensors) or starts after the batch's sweep (its reference
check, under the lock, finds the swept tensors missing and names them; the client uploads them
again). Saves wait for one batch at a time, never for a whole collection. SQLite runs every
transaction under ``BEGIN IMMEDIATE``, which already serializes them; the lock statements are
harmless there.

Two invariants follow, and the tests check them under concurrent saves:

1. Every digest a committed version references has a tensor row (commits check under the lock,
   sweeps delete only unreferenced rows under the lock).
2. Every shard row has its blob: a blob is deleted only under the exclusive lock and only while
   no row names it, and a shard row is recorded only under the share lock after checking that
   its blob is there (:func:`service.intake.ingest.record_shard`), so a re-upload racing the deletion of the
   same shard is either seen by the deletion (which then keeps the blob) or sees the blob gone
   (and stores it again).

Blobs with no shard row (*orphans*: a sweep that died between its transaction and its deletes,
or an upload between storing its blob and recording it) are reported. They are deleted only
when asked (``orphans=True``): the blob store cannot tell an orphan's age, so an upload caught
in that window fails and must be retried.

Uploads a writer killed part-way left in the blob store (incomplete S3 multipart uploads, see
:mod:`service.blobs.s3_uploads`) are reported when nothing was added to them within the grace
period, and aborted with the orphans; a live upload caught by a grace of 0 fails and is retried.
So are uploads clients sent to the blob store themselves and never finished or had verified
(staged objects and their multipart uploads, :meth:`service.blobs.base.StagingArea.sweep`): they
count as stale uploads, and go with the orphans once idle past the grace period.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select
from sqlalchemy.orm import Session, aliased

from ckptstore.service.blobs import BlobStore, StaleUploads
from ckptstore.service.catalog.manifest_parts import delete_parts, unlisted_parts
from ckptstore.service.db import Database, holds
from ckptstore.service.db.lock import hold_exclusive
from ckptstore.service.db.models import ManifestPart, PartRef, Shard, Tensor, TensorNeed, utcnow
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.records import GcReport

#: Unreferenced shards younger than this, or with a tensor reported present this recently, stay.
DEFAULT_GRACE_SECONDS = 3600
MAX_GRACE_SECONDS = 10 * 365 * 86400
#: Ids per IN list: below even old SQLite's limit of 999 bound parameters.
IN_LIST = 500
#: Shards swept, and blobs deleted, per hold of the exclusive lock (which makes saves wait): about
#: 0.1-0.4 s of database work, or 100 file or object deletions.
SWEEP_BATCH = 2000
#: Sweeps one collection runs at most: one more per link of the longest delta chain it frees.
MAX_SWEEP_ROUNDS = 18
BLOB_BATCH = 100


def check_grace(grace_seconds: int) -> None:
    """InvalidInputError unless ``grace_seconds`` is between 0 and :data:`MAX_GRACE_SECONDS`."""
    if isinstance(grace_seconds, bool) or not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
        raise InvalidInputError(f"grace_seconds must be between 0 and {MAX_GRACE_SECONDS}, not {grace_seconds!r}")


@dataclass(frozen=True)
class _Unreferenced:
    shard_id: str
    size: int
    tensors: int
    #: Recent, or a tensor of it was reported present, within the grace period; or a live save holds one.
    protected: bool


def _unreferenced_shards(
    session: Session, cutoff: datetime, now: datetime, among: Sequence[str] | None = None
) -> list[_Unreferenced]:
    """Every shard (or those of ``among``) none of whose tensors a committed version references;
    ``cutoff`` ends the grace period, a save alive at ``now`` holds."""
    inner = aliased(Tensor)
    referenced = (
        select(inner.digest)
        .join(PartRef, PartRef.digest == inner.digest)
        .join(ManifestPart, ManifestPart.id == PartRef.part_id)
        .where(inner.shard_id == Shard.id, ManifestPart.versions > 0)
        .correlate(Shard)
    )
    needed = aliased(Tensor)
    # A tensor a stored delta decodes from stays while that delta's row does.
    needed_by_delta = (
        select(needed.digest)
        .join(TensorNeed, TensorNeed.needs == needed.digest)
        .where(needed.shard_id == Shard.id)
        .correlate(Shard)
    )
    statement = (
        select(Shard.id, Shard.size, Shard.created_at, func.max(Tensor.last_seen_at), func.count(Tensor.digest))
        .outerjoin(Tensor, Tensor.shard_id == Shard.id)
        .where(~referenced.exists(), ~needed_by_delta.exists())
        .group_by(Shard.id, Shard.size, Shard.created_at)
        .order_by(Shard.id)
    )
    if among is None:
        rows = list(session.execute(statement))
    else:
        rows = [row for ids in _batches(among, IN_LIST) for row in session.execute(statement.where(Shard.id.in_(ids)))]
    held = holds.held_shards(session, now, among)
    return [
        _Unreferenced(
            shard_id=shard_id,
            size=int(size),
            tensors=int(count),
            protected=created_at >= cutoff or (seen is not None and seen >= cutoff) or shard_id in held,
        )
        for shard_id, size, created_at, seen, count in rows
    ]


def _batches(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _recorded(session: Session, shard_ids: Sequence[str]) -> set[str]:
    return set(session.scalars(select(Shard.id).where(Shard.id.in_(shard_ids))))


def _sweep_rows(
    db: Database, shard_ids: Sequence[str], cutoff: datetime, now: datetime
) -> tuple[list[_Unreferenced], int, bool]:
    """Delete the rows of those of ``shard_ids`` still sweepable; returns them, how many are now in
    grace or held, and whether a swept tensor was a delta (what it decoded from may be sweepable now)."""
    freed = False
    with db.transaction() as session:
        hold_exclusive(session)
        # Marked again under the lock: since the first look a commit may have referenced some, or
        # a save been told some are present or stored some (and holds them).
        marked = _unreferenced_shards(session, cutoff, now, shard_ids)
        still = [u for u in marked if not u.protected]
        for ids in _batches([u.shard_id for u in still], IN_LIST):
            swept_tensors = select(Tensor.digest).where(Tensor.shard_id.in_(ids))
            needs = session.execute(delete(TensorNeed).where(TensorNeed.digest.in_(swept_tensors)))
            freed = freed or bool(cast(CursorResult[Any], needs).rowcount)
            session.execute(delete(Tensor).where(Tensor.shard_id.in_(ids)))
            session.execute(delete(Shard).where(Shard.id.in_(ids)))
        return still, len(marked) - len(still), freed


def _drop_lapsed_holds(db: Database, now: datetime) -> None:
    """Delete the holds of saves whose lease lapsed by ``now`` (under the exclusive lock, so a save
    renewing at that moment either renewed first, and stays, or starts afresh after)."""
    with db.transaction() as session:
        hold_exclusive(session)
        holds.drop_lapsed(session, now)


def _sweep_parts(db: Database) -> int:
    """Delete every manifest part no version lists, a batch per hold of the exclusive lock; how many."""
    swept = 0
    while True:
        with db.transaction() as session:
            hold_exclusive(session)
            ids = unlisted_parts(session, SWEEP_BATCH)
            delete_parts(session, ids)
        swept += len(ids)
        if len(ids) < SWEEP_BATCH:
            return swept


def _delete_unrecorded_blobs(db: Database, blobs: BlobStore, shard_ids: Sequence[str]) -> int:
    """Delete the blobs of ``shard_ids`` that no shard row names (checked under the exclusive lock)."""
    deleted = 0
    for batch in _batches(shard_ids, BLOB_BATCH):
        with db.transaction() as session:
            hold_exclusive(session)
            # A shard swept a moment ago may have been uploaded and recorded again since.
            again = _recorded(session, batch)
            for shard_id in batch:
                if shard_id not in again:
                    blobs.delete(shard_id)
                    deleted += 1
    return deleted


def _orphans(db: Database, blobs: BlobStore) -> list[str]:
    """Blob ids with no shard row, in the blob store's listing order."""
    found: list[str] = []
    pending: list[str] = []

    def check() -> None:
        with db.transaction() as session:
            recorded = _recorded(session, pending)
        found.extend(b for b in pending if b not in recorded)
        pending.clear()

    for blob_id in blobs.list_ids():
        pending.append(blob_id)
        if len(pending) >= IN_LIST:
            check()
    if pending:
        check()
    return found


def _stale_uploads(blobs: BlobStore, cutoff: datetime, *, dry_run: bool) -> StaleUploads:
    """Unfinished blob uploads and staged client uploads idle since ``cutoff``, aborted unless ``dry_run``."""
    found = blobs.abort_stale_uploads(cutoff, dry_run=dry_run)
    staging = blobs.staging()
    if staging is None:
        return found
    staged = staging.sweep(cutoff, dry_run=dry_run)
    return StaleUploads(
        found=found.found + staged.found, bytes=found.bytes + staged.bytes, aborted=found.aborted + staged.aborted
    )


def collect(
    db: Database,
    blobs: BlobStore,
    *,
    grace_seconds: int = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    orphans: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Sweep unreferenced shards older than the grace period; report what went (or would go).

    Args:
        db: the metadata database.
        blobs: the blob store holding the shards.
        grace_seconds: keep unreferenced shards recorded, or with a tensor reported present,
            less than this many seconds before ``now``. 0 keeps nothing unreferenced but what
            saves in progress hold (whatever the grace).
        dry_run: only report; change nothing and take no lock.
        orphans: also delete blobs that no shard row names, and abort uploads left
            unfinished with nothing added within the grace period (see the module docstring).
        now: the time the grace period counts back from (tests pass one; default: now).

    Raises:
        InvalidInputError: ``grace_seconds`` is negative or absurdly large.
        StorageError: the database or blob store failed; what was swept stays swept, blobs not
            yet deleted are reported as orphans by the next run.
    """
    check_grace(grace_seconds)
    started = time.perf_counter()
    now = now or utcnow()
    cutoff = now - timedelta(seconds=grace_seconds)
    if not dry_run:
        _drop_lapsed_holds(db, now)
        _sweep_parts(db)  # the mark below ignores them anyway; this reclaims their rows
    with db.transaction() as session:
        total = int(session.scalar(select(func.count()).select_from(Shard)) or 0)
    swept: list[_Unreferenced] = []
    # A round sweeping a delta may free what it decoded from: a chain goes in one collection,
    # a round per link (a dry run looks once).
    for _round in range(MAX_SWEEP_ROUNDS):
        # A first look without the lock; each batch is marked again under it before anything
        # goes, so saves wait for one batch at a time, never for the whole collection.
        with db.transaction() as session:
            unreferenced = _unreferenced_shards(session, cutoff, now)
        candidates = [u for u in unreferenced if not u.protected]
        in_grace = len(unreferenced) - len(candidates)
        if dry_run:
            swept = candidates
            break
        freed = False
        for batch in _batches([u.shard_id for u in candidates], SWEEP_BATCH):
            gone, seen_meanwhile, freed_batch = _sweep_rows(db, batch, cutoff, now)
            in_grace += seen_meanwhile
            freed = freed or freed_batch
            # Only once their rows are committed: a blob must never go while a row names it.
            _delete_unrecorded_blobs(db, blobs, [u.shard_id for u in gone])
            swept.extend(gone)
        if not freed:
            break
    orphan_ids = _orphans(db, blobs)
    orphan_bytes = sum(blobs.size(blob_id) or 0 for blob_id in orphan_ids)
    orphans_swept = _delete_unrecorded_blobs(db, blobs, orphan_ids) if orphans and not dry_run else 0
    uploads = _stale_uploads(blobs, cutoff, dry_run=dry_run or not orphans)
    return GcReport(
        dry_run=dry_run,
        grace_seconds=grace_seconds,
        shards_swept=len(swept),
        tensors_swept=sum(u.tensors for u in swept),
        bytes_swept=sum(u.size for u in swept),
        shards_kept=total - len(swept),
        shards_in_grace=in_grace,
        orphan_blobs=len(orphan_ids),
        orphan_bytes=orphan_bytes,
        orphans_swept=orphans_swept,
        stale_uploads=uploads.found,
        stale_upload_bytes=uploads.bytes,
        uploads_aborted=uploads.aborted,
        seconds=time.perf_counter() - started,
    )


__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "MAX_GRACE_SECONDS",
    "check_grace",
    "collect",
]
