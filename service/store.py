"""The engine: the operations embedded clients call in-process and the HTTP face serves.

Write path: :meth:`Store.missing` → :meth:`Store.ingest_file` per shard → :meth:`Store.commit`.
Blobs are stored first and the version row last, in one transaction, so a version becomes
visible only once every byte it references is stored and verified. :meth:`Store.gc` reclaims
shards no version references; each step of the write path holds the collection lock in share
mode (:mod:`service.gc`), so a sweep never removes what a save in progress relies on.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Text, bindparam, func, select, type_coerce, update
from sqlalchemy.orm import Session

from service.blobs import BlobStore, LocalBlobStore
from service.blobs.base import READ_CHUNK_BYTES
from service.cleanup import STALE_SECONDS, CleanupReport, clean_staging
from service.db import Database
from service.db.models import Run, Shard, Tag, Tensor, Version, table, utcnow
from service.db.session import insert_missing, insert_new
from service.db.shapes import ShapeCache
from service.errors import InvalidInputError, NotFoundError, StorageError
from service.format.bounds import INT64_MAX, MAX_SIZES_PER_QUERY
from service.format.digest import all_digests, is_digest
from service.format.dtypes import DTYPES, byte_length
from service.format.names import LATEST, parse_ref, validate_run_id, validate_tag
from service.format.safetensors_header import MAX_HEADER_BYTES, ShardHeader, layout_order, read_header
from service.format.sharding import SHARD_METADATA
from service.gc import DEFAULT_GRACE_SECONDS, check_grace, collect, hold_shared
from service.ingest import verify_shard_file
from service.listings import latest_versions, one_version, run_versions
from service.manifest_parts import manifest_text, release_versions
from service.receiver import ShardReceiver
from service.records import GcReport, RetentionPolicy, RunInfo, ShardReceipt, TensorLocation, VersionInfo
from service.retention import apply_policy, describe_policy, lock_run, read_policy, write_policy
from service.retention_rules import check_policy
from service.settings import METADATA_FILE, Settings
from service.shard_writer import UnhashedTensor, WrittenShard, write_shard
from service.write_probe import choose_direct_writes

if TYPE_CHECKING:
    from service.format.manifest import Manifest, ManifestBody

# Committing, compacting and parsing manifests import the manifest models (pydantic schemas
# with patterns), which a listing never needs: those methods import them when first called, so
# `ckptstore ls` starts without them.

QUERY_BATCH = 500
MAX_DIGESTS_PER_QUERY = 100_000
#: A shard re-uploaded while a sweep deletes it is stored again; this many tries at most.
INGEST_ATTEMPTS = 3


def _batches(items: Sequence[str], size: int = QUERY_BATCH) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _check_digests(digests: Iterable[str]) -> list[str]:
    unique = list(dict.fromkeys(digests))
    if len(unique) > MAX_DIGESTS_PER_QUERY:
        raise InvalidInputError(f"{len(unique)} digests in one request; the limit is {MAX_DIGESTS_PER_QUERY}")
    if not all_digests(unique):
        bad = next(d for d in unique if not is_digest(d))
        raise InvalidInputError(f"{str(bad)[:80]!r} is not a digest (64 lowercase hex characters)")
    return unique


_TENSORS = table(Tensor)
_RUNS = table(Run)
# The write path's statements, built once and run on the session's connection: building them
# per call and the ORM's handling of their results took about half of Store.missing.
_ANY_OF_SIZE = select(_TENSORS.c.nbytes).where(_TENSORS.c.nbytes == bindparam("nbytes")).limit(1)
_PRESENT = select(_TENSORS.c.digest).where(_TENSORS.c.digest.in_(bindparam("digests", expanding=True)))
# Rows another transaction is stamping right now are skipped rather than waited for: two saves
# asking about overlapping digests in different orders would otherwise deadlock, and the other
# stamp is as fresh as this one.
_STAMP_SEEN = (
    update(_TENSORS)
    .where(_TENSORS.c.digest.in_(_PRESENT.with_for_update(skip_locked=True).scalar_subquery()))
    .values(last_seen_at=bindparam("now"))
)
_SHARD_KNOWN = select(Shard.id).where(Shard.id == bindparam("shard_id"))
_LOCATE = select(
    _TENSORS.c.digest,
    _TENSORS.c.shard_id,
    _TENSORS.c.offset,
    _TENSORS.c.nbytes,
    _TENSORS.c.dtype,
    type_coerce(_TENSORS.c.shape, Text),
).where(_TENSORS.c.digest.in_(bindparam("digests", expanding=True)))


class Store:
    """A checkpoint store over one metadata database and one blob store.

    Args:
        db: the metadata database.
        blobs: where shard files live.
        staging_dir: a local folder for shards being received or written.
        max_header_bytes: cap on a shard's JSON header.
        direct_writes: write shards around the page cache where the file system allows it
            (:mod:`service.direct_file`); None: whichever way is faster on the staging
            folder's disk, measured before the first shard is written and kept there
            (:mod:`service.write_probe`).
    """

    #: Takes tensors whose digests the caller does not know (:meth:`put_tensors`).
    takes_unhashed = True

    def __init__(
        self,
        db: Database,
        blobs: BlobStore,
        staging_dir: Path,
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        direct_writes: bool | None = True,
    ) -> None:
        self.db = db
        self.blobs = blobs
        self.staging_dir = Path(staging_dir)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self.max_header_bytes = max_header_bytes
        self._direct_writes = direct_writes
        self._direct_lock = threading.Lock()

    @property
    def direct_writes(self) -> bool:
        """Whether shards are written around the page cache: as configured, else as measured
        (once per staging folder, then read from its cache) on the staging folder's disk."""
        if self._direct_writes is None:
            with self._direct_lock:
                if self._direct_writes is None:
                    self._direct_writes = choose_direct_writes(self.staging_dir).direct
        return self._direct_writes

    def prepare_writes(self) -> None:
        """Settle the write mode now (measuring the disk if nothing says which), so that the
        first save does not pay for the measurement; a client that saves calls this on opening."""
        _ = self.direct_writes

    @classmethod
    def open_home(cls, home: Path | str, *, direct_writes: bool | None = None) -> Store:
        """The embedded store in folder ``home``: ``metadata.db``, ``blobs/`` and ``staging/``.

        ``direct_writes`` defaults to the ``CKPTSTORE_DIRECT_WRITES`` setting (unset: measured).
        """
        home = Path(home).expanduser()
        home.mkdir(parents=True, exist_ok=True)
        if direct_writes is None:
            direct_writes = Settings().direct_writes
        database = Database.sqlite_file(home / METADATA_FILE)
        return cls(database, LocalBlobStore(home / "blobs"), home / "staging", direct_writes=direct_writes)

    def close(self) -> None:
        """Release database connections."""
        self.db.dispose()

    def clean_staging(self, older_than_seconds: float = STALE_SECONDS, *, now: float | None = None) -> CleanupReport:
        """Delete temporary shard files that killed clients or servers left, once older than the threshold.

        See :func:`service.cleanup.clean_staging`; pass 0 only when no save is running.
        """
        return clean_staging(self, older_than_seconds, now)

    # -- writing -------------------------------------------------------------------------

    def staging_path(self) -> Path:
        """A fresh path in the staging folder for a shard being written or received."""
        return self.staging_dir / f"{uuid.uuid4().hex}.incomplete"

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The digests among ``digests`` whose tensors the store does not hold, in input order.

        Those reported present are stamped as seen now: the client may commit a reference to
        them without sending them, so garbage collection spares them for its grace period.
        """
        wanted = _check_digests(digests)
        present: set[str] = set()
        now = utcnow()
        with self.db.transaction() as session:
            # Under the collection lock: a sweep either ran before (they are reported missing)
            # or runs after and sees the stamp.
            hold_shared(session)
            connection = session.connection()
            for batch in _batches(wanted):
                found = sorted(connection.execute(_PRESENT, {"digests": batch}).scalars())
                if found:
                    _stamp_seen(session, found, now)
                present.update(found)
        return [d for d in wanted if d not in present]

    def sizes_held(self, sizes: Iterable[int]) -> set[int]:
        """Those of ``sizes`` (byte lengths) that some stored tensor has.

        A tensor of a size no stored tensor has is not stored: a save writes it at once and
        lets the store hash it as it writes it, instead of hashing it first to ask. The answer
        is a hint, not a promise (another save may store such a tensor a moment later, and
        then its bytes are kept twice until garbage collection compacts them). One index
        probe per size, whatever the number of stored tensors.

        Raises:
            InvalidInputError: a size is not a positive integer, or more than
                :data:`MAX_SIZES_PER_QUERY` distinct sizes are asked about.
        """
        unique = set(sizes)
        if len(unique) > MAX_SIZES_PER_QUERY:
            raise InvalidInputError(f"{len(unique)} sizes in one request; the limit is {MAX_SIZES_PER_QUERY}")
        if any(type(size) is not int or not 1 <= size <= INT64_MAX for size in unique):
            raise InvalidInputError(f"tensor sizes must be integers from 1 to {INT64_MAX}")
        wanted = sorted(unique)
        with self.db.transaction() as session:
            connection = session.connection()
            return {size for size in wanted if connection.execute(_ANY_OF_SIZE, {"nbytes": size}).first()}

    def ingest_file(self, path: Path) -> ShardReceipt:
        """Validate the shard at ``path``, store it and record its tensors; idempotent.

        The file is consumed (moved into the blob store or deleted) whatever the outcome.

        Raises:
            InvalidShardError: the file is not a valid shard.
            IntegrityError: a tensor's bytes do not match its digest name.
            StorageError: garbage collection kept deleting the shard while it was stored; retry.
        """
        path = Path(path)
        try:
            with open(path, "rb") as handle:
                header = read_header(handle, path.stat().st_size, max_header_bytes=self.max_header_bytes)
            verified = False

            def verify() -> None:
                nonlocal verified
                if not verified:
                    verify_shard_file(path, max_header_bytes=self.max_header_bytes)
                    verified = True

            return self._store_shard(path, header, verify)
        finally:
            path.unlink(missing_ok=True)

    def receiver(
        self, *, expected_id: str | None = None, max_bytes: int | None = None, write_behind: bool = False
    ) -> ShardReceiver:
        """A :class:`ShardReceiver` writing into this store's staging folder; pass it to :meth:`ingest_received`.

        ``write_behind`` writes on a background thread while the next bytes are hashed: an
        upload's bytes keep arriving meanwhile (measured: 10-20 % faster HTTP saves), where an
        embedded save's other threads already keep both cores busy (there it costs ~5 %).
        """
        return ShardReceiver(
            self.staging_path(),
            expected_id=expected_id,
            max_bytes=max_bytes,
            max_header_bytes=self.max_header_bytes,
            direct_writes=self.direct_writes,
            write_behind=write_behind,
        )

    def ingest_received(self, receiver: ShardReceiver) -> ShardReceipt:
        """Store the shard ``receiver`` took in whole (its bytes were hashed on the way); idempotent.

        The staging file is consumed whatever the outcome.
        """
        try:
            header = receiver.finish()
            return self._store_shard(receiver.path, header, lambda: None)
        finally:
            receiver.discard()

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
    ) -> ShardReceipt:
        """Store a shard given as its header bytes and its tensors' bytes in header order.

        Each piece is written to a staging file and hashed from the same memory, then the file
        is moved into the blob store: one write, one hash, nothing read back. ``on_bytes`` is
        called with each piece's size once it is written.
        """
        receiver = self.receiver()
        try:
            receiver.write(header)
            for piece in pieces:
                receiver.write(piece)
                if on_bytes is not None:
                    on_bytes(piece.nbytes)
        except BaseException:
            receiver.discard()
            raise
        return self.ingest_received(receiver)

    def put_tensors(
        self, tensors: Sequence[UnhashedTensor], on_bytes: Callable[[int], object] | None = None
    ) -> tuple[ShardReceipt, list[str]]:
        """Store tensors whose digests the caller does not know as one shard; returns the receipt
        and each tensor's digest, in the order given.

        Each tensor is hashed from the memory it is written from (see :mod:`service.shard_writer`),
        so nothing is hashed twice; tensors equal to one before them are written once.
        ``on_bytes`` is called with each tensor's size once it is written.
        """
        if not tensors:
            raise InvalidInputError("no tensors to store")
        for tensor in tensors:
            if tensor.dtype not in DTYPES or tensor.data.nbytes != byte_length(tensor.dtype, tensor.shape):
                shape = list(tensor.shape)
                raise InvalidInputError(f"{tensor.data.nbytes} bytes are not a tensor of {tensor.dtype}{shape}")
            if tensor.data.nbytes == 0:
                raise InvalidInputError("an empty tensor needs no storage; leave it out")
        order = layout_order([tensor.dtype for tensor in tensors])
        receipt, written = self._write_tensors([tensors[i] for i in order], on_bytes)
        digests = [""] * len(tensors)
        for index, digest in zip(order, written.digests, strict=True):
            digests[index] = digest
        return receipt, digests

    def _write_tensors(
        self, tensors: Sequence[UnhashedTensor], on_bytes: Callable[[int], object] | None = None
    ) -> tuple[ShardReceipt, WrittenShard]:
        """Write ``tensors``, in the order given, as one shard, hashing each, and store it."""
        path = self.staging_path()
        try:
            written = write_shard(path, tensors, SHARD_METADATA, direct_writes=self.direct_writes, on_bytes=on_bytes)
            return self._store_shard(path, written.header, lambda: None), written
        finally:
            path.unlink(missing_ok=True)

    def _compaction_write(self, tensors: Sequence[UnhashedTensor]) -> tuple[ShardHeader, list[str]]:
        _receipt, written = self._write_tensors(tensors)
        return written.header, written.digests

    def _store_shard(self, path: Path, header: ShardHeader, verify: Callable[[], None]) -> ShardReceipt:
        """Move a validated shard file into the blob store and record it; ``verify`` runs first if it is new."""
        for _attempt in range(INGEST_ATTEMPTS):
            with self.db.transaction() as session:
                known = session.connection().execute(_SHARD_KNOWN, {"shard_id": header.shard_id}).first() is not None
            if not known:
                # Only a shard not yet stored is hashed: a known id names bytes already verified.
                verify()
                self.blobs.put_file(header.shard_id, path)
            created = self._record_shard(header.shard_id, header.file_size, header)
            if created is not None:
                return ShardReceipt(
                    shard_id=header.shard_id, size=header.file_size, tensors=len(header.entries), created=created
                )
            if not path.exists():  # the blob store took the file, and a sweep then deleted it
                break
        raise StorageError(
            f"shard {header.shard_id} was deleted by garbage collection while it was being stored; retry the upload"
        )

    def _record_shard(self, shard_id: str, size: int, header: ShardHeader) -> bool | None:
        """Record the shard and its tensors not stored elsewhere; whether the shard row is new.

        None (and nothing recorded) if the blob is gone: a sweep deleted it after this shard
        was found stored or put in place. The check runs under the collection lock, so a sweep
        cannot delete the blob between it and the commit of the rows.

        Concurrent ingests of the same shard, or of shards sharing tensors, all succeed: rows
        already there (or being inserted by another transaction) are skipped, so a tensor keeps
        its first location. Tensors go in digest order so two ingests never deadlock. A known
        shard's tensors are recorded too: a sweep may have removed their rows where they were
        first stored, and this shard's bytes were verified when it was first stored.
        """
        tensors = {
            entry.digest: {
                "digest": entry.digest,
                "shard_id": shard_id,
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "offset": header.data_start + entry.begin,
                "nbytes": entry.nbytes,
            }
            for entry in header.entries
        }
        try:
            with self.db.transaction() as session:
                hold_shared(session)
                created = insert_new(session, Shard, {"id": shard_id, "size": size})
                insert_missing(session, Tensor, [tensors[digest] for digest in sorted(tensors)])
                if self.blobs.size(shard_id) is None:
                    raise _BlobSwept
                return created
        except _BlobSwept:
            return None

    def commit(self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = ()) -> VersionInfo:
        """Commit ``body`` as the next version of ``run_id`` (created if new).

        Raises:
            MissingTensorsError: the body references digests the store lacks (listed).
            InvalidManifestError: a digest's dtype or shape disagrees with the stored tensor.
        """
        validate_run_id(run_id)
        tags = [validate_tag(t) for t in tags]
        from service.commit import commit_version

        with self.db.transaction() as session:
            return commit_version(session, run_id, body, tags)

    # -- garbage collection --------------------------------------------------------------

    def gc(
        self,
        *,
        grace_seconds: int | None = None,
        dry_run: bool = False,
        orphans: bool = False,
        compact_below: float | None = None,
        now: datetime | None = None,
    ) -> GcReport:
        """Delete shards no committed version references, sparing recent ones; see :mod:`service.gc`.

        Args:
            grace_seconds: spare unreferenced shards recorded, or reported present by
                :meth:`missing`, less than this long ago (default one hour).
            dry_run: only report what would be swept.
            orphans: also delete blobs no shard row names.
            compact_below: first compact every shard whose live bytes are below this fraction
                of its size (see :mod:`service.compaction`); the shards it retires are swept
                once the grace period has passed.
            now: the time the grace period counts back from (default: now).
        """
        grace = DEFAULT_GRACE_SECONDS if grace_seconds is None else grace_seconds
        compaction = None
        if compact_below is not None:
            from service.compaction import compact

            check_grace(grace)
            cutoff = (now or utcnow()) - timedelta(seconds=grace)
            compaction = compact(
                self.db, self.blobs, self._compaction_write, below=compact_below, cutoff=cutoff, dry_run=dry_run
            )
        report = collect(self.db, self.blobs, grace_seconds=grace, dry_run=dry_run, orphans=orphans, now=now)
        if compaction is None:
            return report
        return report.model_copy(
            update={"shards_compacted": compaction.shards, "bytes_compacted": compaction.bytes_reclaimable}
        )

    # -- reading -------------------------------------------------------------------------

    def resolve(self, run_id: str, ref: int | str = LATEST) -> int:
        """The version number that ``ref`` (a number, 'latest' or a tag) names in ``run_id``."""
        with self.db.transaction() as session:
            return _resolve(session, validate_run_id(run_id), ref)

    def manifest(self, run_id: str, ref: int | str = LATEST) -> Manifest:
        """The manifest of the version ``ref`` names."""
        from service.format.manifest import manifest_from_json

        with self.db.transaction() as session:
            version = _resolve(session, validate_run_id(run_id), ref)
            return manifest_from_json(manifest_text(session, run_id, version))

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes live; NotFoundError names any the store lacks."""
        wanted = _check_digests(digests)
        found: dict[str, TensorLocation] = {}
        shapes = ShapeCache()
        with self.db.transaction() as session:
            connection = session.connection()
            for batch in _batches(wanted):
                # Plain tuples through a statement built once: an ORM object per tensor was a
                # third of loading a model of many small tensors.
                # ``all()`` fetches the rows at once; iterating a result fetches them one by one.
                rows = connection.execute(_LOCATE, {"digests": batch}).all()
                for digest, shard_id, offset, nbytes, dtype, shape in rows:
                    found[digest] = TensorLocation(digest, shard_id, offset, nbytes, dtype, shapes(shape))
        absent = [d for d in wanted if d not in found]
        if absent:
            raise NotFoundError(f"{len(absent)} tensors are not in the store, e.g. {absent[0]}")
        return found

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from shard ``shard_id`` starting at byte ``offset``."""
        if not is_digest(shard_id):
            raise InvalidInputError(f"{shard_id[:80]!r} is not a shard id")
        self.blobs.read_into(shard_id, offset, buffer)

    def read_scatter(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn with shard ``shard_id``'s consecutive bytes from ``offset``."""
        if not is_digest(shard_id):
            raise InvalidInputError(f"{shard_id[:80]!r} is not a shard id")
        self.blobs.read_scatter(shard_id, offset, buffers)

    def shard_size(self, shard_id: str) -> int:
        """Size in bytes of a stored shard; NotFoundError if absent."""
        if not is_digest(shard_id):
            raise InvalidInputError(f"{shard_id[:80]!r} is not a shard id")
        size = self.blobs.size(shard_id)
        if size is None:
            raise NotFoundError(f"shard {shard_id} is not in the store")
        return size

    def iter_shard(
        self, shard_id: str, offset: int, length: int, chunk_bytes: int = READ_CHUNK_BYTES
    ) -> Iterator[bytes | memoryview]:
        """Stream ``length`` bytes of a shard from ``offset``, in pieces of ``chunk_bytes`` (the last shorter)."""
        if not is_digest(shard_id):
            raise InvalidInputError(f"{shard_id[:80]!r} is not a shard id")
        return self.blobs.iter_range(shard_id, offset, length, chunk_bytes)

    def ping(self) -> None:
        """Raise StorageError unless the metadata database answers."""
        with self.db.transaction() as session:
            session.execute(select(1))

    def runs(self) -> list[RunInfo]:
        """Every run with its totals, most recently updated first."""
        with self.db.transaction() as session:
            totals = {
                run_id: (count, latest, total, new)
                for run_id, count, latest, total, new in session.execute(
                    select(
                        Version.run_id,
                        func.count(),
                        func.max(Version.version),
                        func.coalesce(func.sum(Version.bytes_total), 0),
                        func.coalesce(func.sum(Version.bytes_new), 0),
                    ).group_by(Version.run_id)
                )
            }
            result = []
            # Columns, not Run objects: `ckptstore ls` of a thousand runs built a thousand ORM
            # objects, and its first ORM query imported SQLAlchemy's loading machinery.
            runs = session.execute(
                select(_RUNS.c.id, _RUNS.c.created_at, _RUNS.c.updated_at).order_by(
                    _RUNS.c.updated_at.desc(), _RUNS.c.id
                )
            )
            for run_id, created_at, updated_at in runs:
                count, latest, total, new = totals.get(run_id, (0, None, 0, 0))
                result.append(
                    RunInfo(
                        run_id=run_id,
                        created_at=created_at,
                        updated_at=updated_at,
                        versions=count,
                        latest_version=latest,
                        bytes_total=int(total),
                        bytes_new=int(new),
                    )
                )
            return result

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of ``run_id``, oldest first (summary columns only, no manifest is read)."""
        with self.db.transaction() as session:
            _require_run(session, validate_run_id(run_id))
            return run_versions(session, run_id)

    def version(self, run_id: str, ref: int | str = LATEST) -> VersionInfo:
        """The summary of the one version ``ref`` names."""
        with self.db.transaction() as session:
            number = _resolve(session, validate_run_id(run_id), ref)
            info = one_version(session, run_id, number)
            assert info is not None  # resolved in this transaction
            return info

    def runs_overview(self) -> list[tuple[RunInfo, VersionInfo | None, list[tuple[str, int]]]]:
        """Every run (as :meth:`runs`) with its newest version and its tags as ``(name, version)`` pairs.

        Three statements whatever the number of runs, and no manifest read.
        """
        runs = self.runs()
        with self.db.transaction() as session:
            latest, tags = latest_versions(session)
        return [(run, latest.get(run.run_id), tags.get(run.run_id, [])) for run in runs]

    # -- tags and deletion ---------------------------------------------------------------

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        validate_tag(name)
        with self.db.transaction() as session:
            # Locked like a commit: a retention policy applied meanwhile must see this tag.
            lock_run(session, validate_run_id(run_id))
            version = _resolve(session, run_id, ref)
            existing = session.get(Tag, (run_id, name))
            if existing is None:
                session.add(Tag(run_id=run_id, name=name, version=version))
            else:
                existing.version = version
            return version

    def untag(self, run_id: str, name: str) -> None:
        """Remove tag ``name`` from ``run_id`` (a reserved name too, should a store hold one)."""
        validate_tag(name, allow_reserved=True)
        with self.db.transaction() as session:
            existing = session.get(Tag, (validate_run_id(run_id), name))
            if existing is None:
                raise NotFoundError(f"run {run_id!r} has no tag {name!r}")
            session.delete(existing)

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete one version (its tags go with it); its blobs stay until garbage collection."""
        with self.db.transaction() as session:
            lock_run(session, validate_run_id(run_id))  # a commit's retention may be removing it too
            version = _resolve(session, run_id, ref)
            session.query(Tag).filter_by(run_id=run_id, version=version).delete()
            release_versions(session, run_id, [version])
            row = session.get(Version, (run_id, version))
            session.delete(row)
            return version

    # -- retention -----------------------------------------------------------------------

    def get_retention(self, run_id: str) -> RetentionPolicy:
        """The run's retention policy and the versions it would remove now (NotFoundError if no run)."""
        with self.db.transaction() as session:
            _require_run(session, validate_run_id(run_id))
            return describe_policy(session, run_id, read_policy(session, run_id))

    def set_retention(
        self,
        run_id: str,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str | None = None,
        create_run: bool = False,
    ) -> RetentionPolicy:
        """Replace the run's retention policy; it is applied at each commit, starting with the next.

        Nothing is removed now (:meth:`apply_retention` does that); the record returned lists
        what applying it would remove. Leaving both ``keep_last`` and ``keep_best`` unset clears
        the policy. A run that does not exist yet is created only with ``create_run`` (as a save
        with a policy does), so a mistyped run id is refused rather than made.

        Raises:
            InvalidInputError: a count below 1, ``keep_best`` without a metric, or a bad mode.
            NotFoundError: the run does not exist and ``create_run`` is not set.
        """
        validate_run_id(run_id)
        policy = check_policy(keep_last, keep_best, metric, mode)
        with self.db.transaction() as session:
            lock_run(session, run_id, create=create_run)
            write_policy(session, run_id, policy)
            return describe_policy(session, run_id, policy)

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now the versions the run's policy does not keep; returns their numbers."""
        with self.db.transaction() as session:
            lock_run(session, validate_run_id(run_id))
            return apply_policy(session, run_id)


class _BlobSwept(Exception):
    """A shard's blob vanished before its rows were recorded (rolls the recording back)."""


def _stamp_seen(session: Session, digests: Sequence[str], now: datetime) -> None:
    session.connection().execute(_STAMP_SEEN, {"digests": digests, "now": now})


def _require_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id!r} does not exist")
    return run


def _resolve(session: Session, run_id: str, ref: int | str) -> int:
    parsed = parse_ref(ref)
    _require_run(session, run_id)
    if parsed == LATEST:
        latest = session.scalar(select(func.max(Version.version)).where(Version.run_id == run_id))
        if latest is None:
            raise NotFoundError(f"run {run_id!r} has no versions")
        return int(latest)
    if isinstance(parsed, int):
        if session.get(Version, (run_id, parsed)) is None:
            raise NotFoundError(f"run {run_id!r} has no version {parsed}")
        return parsed
    tag = session.get(Tag, (run_id, parsed))
    if tag is None:
        raise NotFoundError(f"run {run_id!r} has no tag {parsed!r}")
    return tag.version


__all__ = ["Store"]
