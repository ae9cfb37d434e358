"""Compression at rest: ``gc --compress`` re-encodes the tensors versions added, smallest first.

Saves always store raw bytes (the training loop pays nothing); a collection asked to compress
visits, once each, the committed versions older than its grace period, oldest first within a run,
and for every tensor a version added (raw, at least :data:`MIN_BYTES`) keeps the smallest of:

- its raw bytes (kept where they are: nothing is rewritten for less than
  :data:`~service.reclaim.encoding_choice.MIN_GAIN`);
- ``grouped-zstd``: its bytes grouped by byte position, compressed;
- ``diff-grouped-zstd``: the difference from the *keyframe* of the same key (and chunk),
  element by element, compressed the same way (a full fine-tune moves each weight a few units in
  its last place, so the differences are mostly zero bits), if it
  takes at most :data:`~service.reclaim.encoding_choice.DELTA_AT_MOST` of the tensor stored whole.
  The keyframe is the parent version's tensor if that is stored whole (compressed or raw), or
  the base of the parent's delta; when ``max_deltas`` deltas already decode from it, the tensor
  is stored whole and becomes the next keyframe. Every delta thus decodes from one payload
  below it: a load decodes at most two per tensor, however many versions a keyframe serves
  (chains of deltas on deltas were a little smaller, and several times slower to load). A tensor
  some delta already decodes from is only ever stored whole.

The encoded tensors go into new shards (format v2: each entry a payload of
:mod:`service.format.encoding`, stored as bytes), written as compaction writes (see
:mod:`service.reclaim.compaction`): the blob first, then in one transaction under the exclusive
collection lock the shard's row, each tensor's row moved to it (only if still raw where it was),
what each delta needs (``tensor_needs``: garbage collection keeps those tensors), and the old
shards' ``created_at`` stamped, so they wait out a grace period before a sweep, as a load that
located a tensor there a moment ago still reads it. A process killed at any step leaves every
version loadable: an unrecorded blob is an orphan (``gc --orphans``), a version not yet marked
is visited again, and a tensor already moved is skipped.
"""

from __future__ import annotations

import functools
import json
import os
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from ckptstore.service.blobs import BlobStore
from ckptstore.service.blobs.held_file import hold_new
from ckptstore.service.catalog import lookup
from ckptstore.service.catalog.manifest_parts import part_bodies
from ckptstore.service.db import Database
from ckptstore.service.db.lock import hold_exclusive
from ckptstore.service.db.models import Shard, Tensor, TensorNeed, Version, table, utcnow
from ckptstore.service.db.session import insert_missing, insert_new
from ckptstore.service.errors import IntegrityError, NotFoundError, StorageError, StorageFullError
from ckptstore.service.format.digest import shard_id as blob_id_of
from ckptstore.service.format.dtypes import itemsize
from ckptstore.service.format.encoded_reads import ReadInto, chain_of, read_raw
from ckptstore.service.format.encoding import DELTAS
from ckptstore.service.format.records import TensorLocation
from ckptstore.service.format.safetensors_header import header_bytes
from ckptstore.service.intake.direct_file import DirectFileWriter
from ckptstore.service.intake.receiver import staging_error
from ckptstore.service.reclaim.compression_buffers import BufferPool, RecentTensors
from ckptstore.service.reclaim.compression_total import tell_total
from ckptstore.service.reclaim.encoding_choice import choose

#: Tensors smaller than this stay raw: the gain is small and every encoded tensor costs a load a decode.
MIN_BYTES = 64 << 10
#: Deltas a keyframe may serve before a tensor is stored whole again (a new keyframe).
DEFAULT_MAX_DELTAS = 4
#: Payload bytes per encoded shard.
SHARD_BYTES = 256 << 20
#: Versions read per query.
VERSION_BATCH = 200
#: Raw bytes of tensors being encoded at once (each holds its bytes, its base's and its payload).
IN_FLIGHT_BYTES = 1 << 30
SHARD_FORMAT = "ckptstore.shard/2"
#: The raw shards compression leaves are compacted when less than this share of them is live.
COMPACT_AFTER_COMPRESSION = 0.5


@dataclass(frozen=True)
class Encoded:
    """One tensor's chosen encoding: its payload and, for a delta, the digests it needs."""

    digest: str
    old_shard: str
    nbytes: int
    encoding: str
    parts: tuple[bytes, ...]  # the payload, in parts written one after the other
    base: str | None
    needs: tuple[str, ...]

    @property
    def size(self) -> int:
        """The payload's length."""
        return sum(map(len, self.parts))


@dataclass
class Compression:
    """What a compressing collection did: versions visited, tensors re-encoded, their raw and stored bytes."""

    versions: int = 0
    tensors: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    deltas: int = 0
    shards: int = 0


def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


#: A stored piece of a tensor: its key, and its chunk's offsets (None: the whole tensor).
Piece = tuple[str, tuple[int, ...] | None]


def _pieces(entries: Iterable[dict[str, object]]) -> dict[Piece, tuple[str, str, list[int]]]:
    """Each stored piece of manifest entries, with its digest, dtype and shape."""
    found: dict[Piece, tuple[str, str, list[int]]] = {}
    for entry in entries:
        key, dtype = str(entry["key"]), str(entry["dtype"])
        if entry.get("digest") is not None:
            found[(key, None)] = (str(entry["digest"]), dtype, list(entry["shape"]))  # type: ignore[call-overload]
        for chunk in entry.get("chunks") or ():  # type: ignore[attr-defined]
            found[(key, tuple(chunk["offsets"]))] = (chunk["digest"], dtype, list(chunk["shape"]))
    return found


def _entries(session: Session, part_ids: Sequence[int]) -> list[dict[str, object]]:
    bodies = part_bodies(session, part_ids)
    return [entry for pid in part_ids for entry in json.loads(bodies[pid])]


def _keyframe(locations: dict[str, TensorLocation], digest: str) -> str:
    """The tensor a delta against ``digest``'s line would decode from: ``digest`` itself when it
    is stored whole, else the bottom of its chain."""
    return chain_of(locations, digest)[-1].digest


def _dependents(session: Session, digests: Sequence[str]) -> dict[str, int]:
    """How many stored deltas decode from each of ``digests`` (those none does are left out)."""
    found: dict[str, int] = {}
    for batch in lookup.batches(digests):
        counted = session.execute(
            select(TensorNeed.needs, func.count()).where(TensorNeed.needs.in_(batch)).group_by(TensorNeed.needs)
        )
        found.update((needs, int(count)) for needs, count in counted)
    return found


def _plan(
    db: Database,
    mine: dict[Piece, tuple[str, str, list[int]]],
    theirs: dict[Piece, tuple[str, str, list[int]]],
    max_deltas: int,
    recent: RecentTensors,
) -> tuple[dict[str, tuple[TensorLocation, str | None]], dict[str, TensorLocation], set[str]] | None:
    """Which of a version's pieces to encode (``mine``, against its parent's ``theirs``), each with
    the keyframe a delta would decode from; their locations; and those some delta already needs.
    None when there is nothing to encode."""
    wanted = sorted({d for d, _, _ in mine.values()} | {d for d, _, _ in theirs.values()})
    locations = lookup.locate(db=db, digests=wanted) if wanted else {}
    jobs: dict[str, tuple[TensorLocation, str | None]] = {}
    inherited = {d for d, _, _ in theirs.values()}
    for piece, (digest, dtype, _shape) in mine.items():
        location = locations[digest]
        if location.encoded or location.nbytes < MIN_BYTES or digest in jobs or digest in inherited:
            continue
        if recent.encoded is not None and digest in recent.encoded:
            continue  # a dry run's: an earlier version (of this run or another) would have encoded it
        parent = theirs.get(piece)
        base = None
        if max_deltas > 0 and parent is not None and parent[0] != digest and parent[1] == dtype:
            candidate = locations[parent[0]]
            if candidate.nbytes == location.nbytes and list(candidate.shape) == list(location.shape):
                planned = recent.planned or {}
                base = planned.get(parent[0]) or _keyframe(locations, parent[0])
        jobs[digest] = (location, base)
    if not jobs:
        return None
    keyframes = sorted({base for _, base in jobs.values() if base is not None})
    unlocated = [digest for digest in keyframes if digest not in locations]  # a dry run's planned keyframes
    if unlocated:
        locations.update(lookup.locate(db=db, digests=unlocated))
    with db.transaction() as session:
        served = _dependents(session, keyframes + sorted(jobs))
    if recent.planned:
        for keyframe in recent.planned.values():
            served[keyframe] = served.get(keyframe, 0) + 1
    depended_on = {digest for digest in jobs if digest in served}
    for digest, (location, base) in jobs.items():
        if base is not None and served.get(base, 0) >= max_deltas:
            jobs[digest] = (location, None)  # its keyframe serves enough deltas: a new keyframe
    return jobs, locations, depended_on


def _encode_version(
    db: Database,
    blobs: BlobStore,
    parts: list[int],
    parent_parts: list[int],
    max_deltas: int,
    report: Compression,
    recent: RecentTensors,
    on_bytes: Callable[[int], object] | None = None,
) -> Generator[Encoded, None, None]:
    """Choose an encoding for every raw tensor a version added (in the parts its parent lacks),
    on a pool of threads, with at most :data:`IN_FLIGHT_BYTES` of tensors on their way; each
    tensor's raw bytes are told to ``on_bytes`` once it is done."""
    added = [pid for pid in dict.fromkeys(parts) if pid not in set(parent_parts)]
    if not added:
        return
    with db.transaction() as session:
        mine = _pieces(_entries(session, added))
        dropped = [pid for pid in dict.fromkeys(parent_parts) if pid not in set(parts)]
        theirs = _pieces(_entries(session, dropped)) if dropped else {}
    planned = _plan(db, mine, theirs, max_deltas, recent)
    if planned is None:
        return
    jobs, locations, depended_on = planned

    pool = ThreadPoolExecutor(_workers(), thread_name_prefix="ckptstore-compress")
    waiting: deque[tuple[int, Future[Encoded | None]]] = deque()
    in_flight = 0

    def done() -> Iterator[Encoded]:
        size, future = waiting.popleft()
        encoded = future.result()
        if on_bytes is not None:
            on_bytes(size)
        return _counted(encoded, report)

    try:
        # In the version's own order (its manifest's), not by digest: every version of a model lays
        # out its tensors alike, so a load reads deltas and their keyframes front to back.
        for digest in jobs:
            size = jobs[digest][0].nbytes
            while waiting and in_flight + size > IN_FLIGHT_BYTES:
                in_flight -= waiting[0][0]
                yield from done()
            location, base = jobs[digest]
            keyframe = None if digest in depended_on else base
            job = pool.submit(_encode_one, blobs.read_into, locations, recent, digest, location, keyframe)
            waiting.append((size, job))
            in_flight += size
        while waiting:
            yield from done()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encode_one(
    read: ReadInto,
    locations: dict[str, TensorLocation],
    recent: RecentTensors,
    digest: str,
    location: TensorLocation,
    base: str | None,
) -> Encoded | None:
    """Read one tensor (and ``base``, the keyframe a delta would decode from, unless the last
    version kept it) and choose its encoding; None leaves it raw."""
    pool = recent.pool
    data = pool.take(location.nbytes)
    read_base: bytearray | None = None
    try:
        read_raw(read, locations, digest, into=data)
        base_bytes = None if base is None else recent.previous.get(base)
        if base is not None and base_bytes is None:
            read_base = base_bytes = read_raw(read, locations, base, into=pool.take(location.nbytes))
        chosen = choose(memoryview(data), itemsize(location.dtype), _view(base_bytes), base)
    except IntegrityError:
        chosen = None  # damaged bytes stay as they are, for `ckptstore verify` to name
    finally:
        if read_base is not None:
            pool.give(read_base)
    if chosen is None:
        pool.give(data)
        return None
    name, parts = chosen
    uses = base if name in DELTAS else None
    needs = () if uses is None else (uses, *(link.digest for link in chain_of(locations, uses)[1:]))
    if not recent.keep(digest, data):
        pool.give(data)
    return Encoded(digest, location.shard_id, location.nbytes, name, tuple(parts), uses, needs)


def _view(data: bytearray | None) -> memoryview | None:
    return None if data is None else memoryview(data)


def _counted(encoded: Encoded | None, report: Compression) -> Iterator[Encoded]:
    if encoded is not None:
        report.tensors += 1
        report.deltas += encoded.base is not None
        report.raw_bytes += encoded.nbytes
        report.stored_bytes += encoded.size
        yield encoded


_TENSORS = table(Tensor)
_MOVE = (
    update(_TENSORS)
    .where(
        _TENSORS.c.digest == bindparam("b_digest"),
        _TENSORS.c.shard_id == bindparam("b_old"),
        _TENSORS.c.encoding.is_(None),
    )
    .values(
        shard_id=bindparam("b_new"),
        offset=bindparam("b_offset"),
        encoding=bindparam("b_encoding"),
        stored_nbytes=bindparam("b_stored"),
        base=bindparam("b_base"),
    )
)


#: Moves an encoded tensor's row to a new shard holding the same payload
#: (see :mod:`service.reclaim.encoded_compaction`).
_REPACK = (
    update(_TENSORS)
    .where(
        _TENSORS.c.digest == bindparam("b_digest"),
        _TENSORS.c.shard_id == bindparam("b_old"),
        _TENSORS.c.encoding == bindparam("b_encoding"),
    )
    .values(shard_id=bindparam("b_new"), offset=bindparam("b_offset"))
)


def write_encoded_shard(
    db: Database,
    blobs: BlobStore,
    staging: Path,
    batch: Sequence[Encoded],
    *,
    repack: bool = False,
    direct_writes: bool = True,
) -> tuple[int, int]:
    """Store ``batch`` as one v2 shard and move its tensors' rows onto it: raw rows (``repack``:
    rows of the same payload in ``old_shard``); how many moved, and the shard's size."""
    head = header_bytes([(e.digest, "U8", [e.size]) for e in batch], {"format": SHARD_FORMAT}, align=8)
    shard_id = blob_id_of(head)
    size = len(head) + sum(e.size for e in batch)
    path = staging / f"{shard_id}.{os.getpid()}.incomplete"
    path.unlink(missing_ok=True)  # a killed collection's, should this process have its number
    held = hold_new(path)  # held, so a sweep of the staging folder leaves it be
    path = held.path
    try:
        writer = DirectFileWriter(path, direct=direct_writes, in_flight=1, exists=True)
        try:
            writer.write(head)
            for item in batch:
                for part in item.parts:
                    writer.write(part)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        blobs.put_file(shard_id, path)  # it makes the file durable
    except StorageError:
        raise
    except OSError as exc:  # the staging file's: a full disk is named as one, never a bare errno
        raise staging_error(exc, path) from exc
    finally:
        held.remove()
    offsets = []
    position = len(head)
    for item in batch:
        offsets.append(position)
        position += item.size
    moved = 0
    with db.transaction() as session:
        hold_exclusive(session)
        insert_new(session, Shard, {"id": shard_id, "size": size})
        connection = session.connection()
        for item, offset in zip(batch, offsets, strict=True):
            row = {
                "b_digest": item.digest, "b_old": item.old_shard, "b_new": shard_id, "b_offset": offset,
                "b_encoding": item.encoding, "b_stored": item.size, "b_base": item.base,
            }  # fmt: skip
            if connection.execute(_REPACK if repack else _MOVE, row).rowcount:
                moved += 1
                insert_missing(session, TensorNeed, [{"digest": item.digest, "needs": n} for n in item.needs])
        old = sorted({item.old_shard for item in batch})
        session.execute(update(Shard).where(Shard.id.in_(old)).values(created_at=utcnow()))
    return moved, size


def _mark(db: Database, run_id: str, version: int) -> None:
    with db.transaction() as session:
        session.execute(
            update(Version).where(Version.run_id == run_id, Version.version == version).values(compressed=True)
        )


def compress(
    db: Database,
    blobs: BlobStore,
    staging: Path,
    cutoff: datetime,
    *,
    max_deltas: int = DEFAULT_MAX_DELTAS,
    dry_run: bool,
    on_bytes: Callable[[int], object] | None = None,
    direct_writes: bool = True,
) -> Compression:
    """Re-encode the tensors of every version committed before ``cutoff`` and not yet visited
    (see the module docstring); on a dry run, count what would be stored without writing.
    ``on_bytes`` is told the raw bytes of each tensor visited, as it is done (and first the
    total, when it has an ``expect`` method: :mod:`service.reclaim.compression_total`); ``direct_writes``
    writes the new shards around the page cache (:mod:`service.intake.direct_file`)."""
    if max_deltas < 0:
        raise ValueError(f"max_deltas {max_deltas} must be at least 0")
    report = Compression()
    recent = RecentTensors(BufferPool(), dry_run=dry_run)
    tell_total(db, cutoff, MIN_BYTES, on_bytes)  # a bar with a total shows the time left
    after: tuple[str, int] = ("", 0)
    while True:
        with db.transaction() as session:
            rows = session.execute(
                select(Version.run_id, Version.version, Version.parent, Version.parts)
                .where(~Version.compressed, Version.created_at < cutoff)
                .where((Version.run_id > after[0]) | ((Version.run_id == after[0]) & (Version.version > after[1])))
                .order_by(Version.run_id, Version.version)
                .limit(VERSION_BATCH)
            ).all()
        for run_id, version, parent, parts in rows:
            with db.transaction() as session:
                parent_parts = (
                    session.scalar(select(Version.parts).where(Version.run_id == run_id, Version.version == parent))
                    if parent is not None
                    else None
                )
            recent.turn()
            ours, theirs = [int(p) for p in parts], [int(p) for p in parent_parts or ()]
            chosen = _encode_version(db, blobs, ours, theirs, max_deltas, report, recent, on_bytes)
            report.versions += 1
            try:
                for batch in _shard_batches(chosen):
                    if recent.planned is not None:
                        recent.planned.update((e.digest, e.base) for e in batch if e.base is not None)
                    if recent.encoded is not None:
                        recent.encoded.update(e.digest for e in batch)
                    if not dry_run:
                        write_encoded_shard(db, blobs, staging, batch, direct_writes=direct_writes)
                        report.shards += 1
            except StorageFullError:
                raise  # no room to write: every next version would meet the same full disk
            except (NotFoundError, StorageError):
                continue  # deleted, and its parts or tensors collected, while it was visited
            finally:
                chosen.close()  # its workers are done before the next version hands their buffers on
            if not dry_run:
                _mark(db, run_id, version)
        if len(rows) < VERSION_BATCH:
            return report
        after = (rows[-1][0], rows[-1][1])


def compressor(
    db: Database,
    blobs: BlobStore,
    staging: Path,
    max_deltas: int,
    dry_run: bool,
    on_bytes: Callable[[int], object] | None = None,
    direct_writes: bool = True,
) -> Callable[[datetime], Compression]:
    """:func:`compress` over a store, waiting for the cutoff its collection computes."""
    return functools.partial(
        compress,
        db,
        blobs,
        staging,
        max_deltas=max_deltas,
        dry_run=dry_run,
        on_bytes=on_bytes,
        direct_writes=direct_writes,
    )


def _shard_batches(chosen: Iterable[Encoded]) -> Iterator[list[Encoded]]:
    batch: list[Encoded] = []
    size = 0
    for item in chosen:
        if batch and size + item.size > SHARD_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.size
    if batch:
        yield batch


__all__ = [
    "COMPACT_AFTER_COMPRESSION",
    "DEFAULT_MAX_DELTAS",
    "MIN_BYTES",
    "SHARD_FORMAT",
    "Compression",
    "Encoded",
    "compress",
    "compressor",
    "write_encoded_shard",
]
