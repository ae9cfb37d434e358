"""Shard compaction: rewrite a mostly dead shard's live tensors into a new shard, then retire it.

Garbage collection keeps a shard whole while any tensor in it is referenced, so one live tensor
can pin a large shard. Compaction reclaims the rest, in three steps that each leave every
version loadable:

1. **Pick.** A shard is a candidate when its live bytes (tensors some listed manifest part
   references, or a stored delta decodes from) are above 0 and below ``below`` times its
   size, and it is outside the grace period (a recent shard, or one with a tensor reported
   present, may be about to be needed).
   A shard of encoded tensors (:mod:`service.reclaim.compression`) counts its live payloads' bytes, and
   is rewritten by :mod:`service.reclaim.encoded_compaction`: its payloads are copied as they are.
2. **Write.** Its live tensors are read from it and stored as a new shard through the ordinary
   write path: hashed again as they are written (a digest that does not come out equal stops
   the collection), content-addressed, recorded under the share lock. A crash here leaves a
   new shard nothing points at: a recent unreferenced shard, swept once its grace ends.
3. **Re-point.** Under the exclusive collection lock, in one transaction, the live tensors'
   location rows move to the new shard, and the old shard's ``created_at`` is stamped with the
   time of this move. Manifests name tensors by digest, so no manifest changes. The old shard
   keeps its dead tensors' rows and its blob; it is unreferenced now and waits out the grace
   period like any unreferenced shard, so a load that located a tensor in it a moment before
   still reads it. A later sweep deletes it.

A commit cannot slip in between: re-pointing holds the lock exclusively, and a tensor row
exists before, during and after the move, so a commit's reference check always finds it. A
tensor of the old shard referenced again after the pick (a save told it was present) stays
where it is, keeping the old shard live: nothing is lost, it is only not reclaimed this time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from ckptstore.service.blobs import BlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.lock import hold_exclusive
from ckptstore.service.db.models import ManifestPart, PartRef, Shard, Tensor, TensorNeed, table, utcnow
from ckptstore.service.errors import IntegrityError, InvalidInputError, NotFoundError
from ckptstore.service.format.records import GcReport
from ckptstore.service.format.safetensors_header import ShardHeader
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.intake.direct_file import ALIGNMENT
from ckptstore.service.reclaim.compression import Compression
from ckptstore.service.reclaim.encoded_compaction import LivePayload, repack
from ckptstore.service.reclaim.gc import check_grace, collect

#: Stores tensors as one new shard, in the order given, and returns its header and each digest.
WriteShard = Callable[[Sequence[UnhashedTensor]], tuple[ShardHeader, list[str]]]


@dataclass(frozen=True)
class Candidate:
    """A shard worth compacting: its id, size, the bytes of its live tensors, and whether it holds encoded ones."""

    shard_id: str
    size: int
    live_bytes: int
    encoded: bool = False


@dataclass(frozen=True)
class Compaction:
    """What compaction did (or, on a dry run, would do): shards rewritten and bytes freed once
    the retired shards are swept (their sizes less the new shards' sizes)."""

    shards: int = 0
    bytes_reclaimable: int = 0


def _is_referenced() -> object:
    listed = (
        select(PartRef.digest)
        .join(ManifestPart, ManifestPart.id == PartRef.part_id)
        .where(PartRef.digest == Tensor.digest, ManifestPart.versions > 0)
        .correlate(Tensor)
        .exists()
    )
    needed = select(TensorNeed.needs).where(TensorNeed.needs == Tensor.digest).correlate(Tensor).exists()
    return or_(listed, needed)


def check_threshold(below: float) -> float:
    """``below`` if it is a fraction in (0, 1]; InvalidInputError otherwise."""
    if isinstance(below, bool) or not isinstance(below, int | float) or not 0 < below <= 1:
        raise InvalidInputError(f"compact_below must be a fraction above 0 and at most 1, not {below!r}")
    return float(below)


def candidates(session: Session, below: float, cutoff: datetime) -> list[Candidate]:
    """Shards outside the grace period whose live bytes are above 0 and below ``below`` of their size."""
    stored = func.coalesce(Tensor.stored_nbytes, Tensor.nbytes)  # a payload's bytes, or the raw tensor's
    live = dict(
        session.execute(
            select(Tensor.shard_id, func.sum(stored)).where(_is_referenced()).group_by(Tensor.shard_id)  # type: ignore[arg-type]
        ).all()
    )
    shards = session.execute(
        select(Shard.id, Shard.size, Shard.created_at, func.max(Tensor.last_seen_at), func.count(Tensor.encoding))
        .join(Tensor, Tensor.shard_id == Shard.id)
        .group_by(Shard.id, Shard.size, Shard.created_at)
        .order_by(Shard.id)
    )
    found = []
    for shard_id, size, created_at, seen, encoded in shards:
        live_bytes = int(live.get(shard_id) or 0)
        recent = created_at >= cutoff or (seen is not None and seen >= cutoff)
        # A new shard's header is padded to a disk block: a shard freeing less is not worth it.
        if not recent and 0 < live_bytes < below * size and size - live_bytes > 2 * ALIGNMENT:
            found.append(Candidate(shard_id=shard_id, size=int(size), live_bytes=live_bytes, encoded=encoded > 0))
    return found


def _live_tensors(db: Database, shard_id: str) -> list[tuple[str, str, list[int], int, int]]:
    """The referenced tensors stored in ``shard_id``: digest, dtype, shape, offset, nbytes, by offset."""
    with db.transaction() as session:
        rows = session.execute(
            select(Tensor.digest, Tensor.dtype, Tensor.shape, Tensor.offset, Tensor.nbytes)
            .where(Tensor.shard_id == shard_id, _is_referenced())  # type: ignore[arg-type]
            .order_by(Tensor.offset)
        )
        return [(d, dtype, list(shape), int(offset), int(nbytes)) for d, dtype, shape, offset, nbytes in rows]


def _live_payloads(db: Database, shard_id: str) -> list[LivePayload]:
    """The referenced encoded tensors stored in ``shard_id``, by offset."""
    with db.transaction() as session:
        rows = session.execute(
            select(Tensor.digest, Tensor.offset, Tensor.nbytes, Tensor.stored_nbytes, Tensor.encoding, Tensor.base)
            .where(Tensor.shard_id == shard_id, Tensor.encoding.is_not(None), _is_referenced())  # type: ignore[arg-type]
            .order_by(Tensor.offset)
        )
        # Encoded rows always have a payload length and an encoding (the query selects only those).
        return [LivePayload(d, int(o), int(n), int(s or 0), str(e), b) for d, o, n, s, e, b in rows]


_TENSORS = table(Tensor)
_REPOINT = (
    update(_TENSORS)
    .where(_TENSORS.c.digest == bindparam("b_digest"), _TENSORS.c.shard_id == bindparam("b_old"))
    .values(shard_id=bindparam("b_new"), offset=bindparam("b_offset"))
)


def _repoint(db: Database, old: str, header: ShardHeader) -> bool:
    """Move the rows of ``header``'s tensors still in ``old`` to the new shard; whether they
    moved and ``old`` is unreferenced afterwards (it then waits out the grace period from now)."""
    with db.transaction() as session:
        hold_exclusive(session)
        if session.get(Shard, header.shard_id) is None:
            return False  # a collection with no grace swept the new shard before the move: try again later
        rows = [
            {"b_digest": e.digest, "b_old": old, "b_new": header.shard_id, "b_offset": header.data_start + e.begin}
            for e in header.entries
        ]
        session.connection().execute(_REPOINT, rows)
        session.execute(update(Shard).where(Shard.id == old).values(created_at=utcnow()))
        still = session.execute(
            select(Tensor.digest).where(Tensor.shard_id == old, _is_referenced()).limit(1)  # type: ignore[arg-type]
        ).first()
        return still is None


def compact_shard(db: Database, blobs: BlobStore, write: WriteShard, shard_id: str) -> int | None:
    """Rewrite ``shard_id``'s live tensors as a new shard and retire it; the new shard's size,
    or None if the shard went meanwhile or is still referenced after the move.

    Raises:
        IntegrityError: a live tensor's bytes no longer hash to its digest.
    """
    live = _live_tensors(db, shard_id)
    if not live:
        return None
    tensors = []
    for _digest, dtype, shape, offset, nbytes in live:
        buffer = bytearray(nbytes)
        try:
            blobs.read_into(shard_id, offset, memoryview(buffer))
        except NotFoundError:
            return None  # swept by another collection since the pick
        tensors.append(UnhashedTensor(dtype=dtype, shape=tuple(shape), data=memoryview(buffer)))
    header, digests = write(tensors)
    expected = [row[0] for row in live]
    if digests != expected:
        wrong = next(e for e, d in zip(expected, digests, strict=True) if e != d)
        raise IntegrityError(f"tensor {wrong} in shard {shard_id} no longer matches its digest; the shard is damaged")
    if not _repoint(db, shard_id, header):
        return None
    return header.file_size


def compact(
    db: Database,
    blobs: BlobStore,
    write: WriteShard,
    *,
    below: float,
    cutoff: datetime,
    dry_run: bool,
    staging: Path | None = None,
) -> Compaction:
    """Compact every candidate shard (see the module docstring); on a dry run only count them.

    Shards of encoded tensors are compacted only given ``staging``, the folder their new shards
    are written in.
    """
    with db.transaction() as session:
        picked = [c for c in candidates(session, check_threshold(below), cutoff) if staging or not c.encoded]
    if dry_run:
        # The new shard holds the live bytes plus a header: a close estimate of what is freed.
        return Compaction(shards=len(picked), bytes_reclaimable=sum(c.size - c.live_bytes for c in picked))
    shards = reclaimable = 0
    for candidate in picked:
        if candidate.encoded and staging is not None:
            new_size = repack(db, blobs, staging, candidate.shard_id, _live_payloads(db, candidate.shard_id))
        else:
            new_size = compact_shard(db, blobs, write, candidate.shard_id)
        if new_size is not None:
            shards += 1
            reclaimable += max(candidate.size - new_size, 0)
    return Compaction(shards=shards, bytes_reclaimable=reclaimable)


def compact_and_collect(
    *,
    db: Database,
    blobs: BlobStore,
    write: WriteShard,
    below: float | None,
    grace_seconds: int,
    dry_run: bool,
    orphans: bool,
    now: datetime | None,
    compress: Callable[[datetime], Compression] | None = None,
    staging: Path | None = None,
) -> GcReport:
    """Compress (given ``compress``, :mod:`service.reclaim.compression`), compact every candidate shard
    (given ``below``), then collect garbage (:func:`service.reclaim.gc.collect`); one report of all three.

    The shards compression and compaction retire are unreferenced from then on, and swept once
    the grace period has passed; the grace period also picks which versions and shards they visit.
    """
    check_grace(grace_seconds)
    cutoff = (now or utcnow()) - timedelta(seconds=grace_seconds)
    compressed = compress(cutoff) if compress is not None else Compression()
    # Counted again: with no grace period, the shards compression just left are compacted now.
    cutoff = (now or utcnow()) - timedelta(seconds=grace_seconds)
    compaction = (
        compact(db, blobs, write, below=below, cutoff=cutoff, dry_run=dry_run, staging=staging)
        if below is not None
        else Compaction()
    )
    report = collect(db, blobs, grace_seconds=grace_seconds, dry_run=dry_run, orphans=orphans, now=now)
    return report.model_copy(
        update={
            "shards_compacted": compaction.shards,
            "bytes_compacted": compaction.bytes_reclaimable,
            "versions_compressed": compressed.versions,
            "tensors_compressed": compressed.tensors,
            "tensors_as_deltas": compressed.deltas,
            "bytes_before_compression": compressed.raw_bytes,
            "bytes_after_compression": compressed.stored_bytes,
        }
    )


__all__ = [
    "Candidate",
    "Compaction",
    "WriteShard",
    "candidates",
    "check_threshold",
    "compact",
    "compact_and_collect",
    "compact_shard",
]
