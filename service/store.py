"""The engine: the operations embedded clients call in-process and the HTTP face serves.

Write path: :meth:`Store.missing` → :meth:`Store.ingest_file` per shard → :meth:`Store.commit`.
Blobs are stored first and the version row last, in one transaction, so a version becomes
visible only once every byte it references is stored and verified. :meth:`Store.gc` reclaims
shards no version references; each step of the write path holds the collection lock in share
mode (:mod:`service.reclaim.gc`), so a sweep never removes what a save in progress relies on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from ckptstore.service.blobs import BlobStore, LocalBlobStore
from ckptstore.service.blobs.base import READ_CHUNK_BYTES
from ckptstore.service.catalog import lookup
from ckptstore.service.catalog.listings import list_runs, list_versions, overview, version_summary
from ckptstore.service.catalog.manifest_parts import manifest_text
from ckptstore.service.catalog.metadata_check import check_metadata
from ckptstore.service.catalog.retention import apply_now, current_policy, replace_policy
from ckptstore.service.catalog.retention_rules import check_policy
from ckptstore.service.catalog.versions import remove_tag, remove_version, resolve_ref, set_tag
from ckptstore.service.db import Database
from ckptstore.service.db.reserve import SpaceReserve, cleanup_with
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.digest import is_digest
from ckptstore.service.format.encoded_reads import read_tensor
from ckptstore.service.format.names import LATEST, validate_run_id
from ckptstore.service.format.records import (
    GcReport,
    MetadataProblem,
    RetentionPolicy,
    RunInfo,
    ShardReceipt,
    TensorLocation,
    VersionInfo,
)
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES, ShardHeader
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.intake import direct_uploads
from ckptstore.service.intake.ingest import Intake
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.reclaim.cleanup import STALE_SECONDS, CleanupReport, clean_staging, with_staging_swept
from ckptstore.service.reclaim.gc import DEFAULT_GRACE_SECONDS, collect
from ckptstore.service.secrets_mask import mask_url
from ckptstore.service.settings import METADATA_FILE, Settings

OnBytes = Callable[[int], object] | None  # told each piece's bytes as they are written
if TYPE_CHECKING:
    from ckptstore.service.format.manifest import Manifest, ManifestBody

# Committing, compacting and parsing manifests import the manifest models when first called,
# so that `ckptstore ls` starts without pydantic's schemas.


class Store:
    """A checkpoint store over one metadata database and one blob store.

    A facade: each method checks its arguments and hands the work to the module for its job
    (lookup, ingest, commit, gc, compaction, listings, versions, retention, cleanup).

    Args:
        db: the metadata database.
        blobs: where shard files live.
        staging_dir: a local folder for shards being received or written.
        max_header_bytes: cap on a shard's JSON header.
        direct_writes: write shards around the page cache where the file system allows it
            (:mod:`service.intake.direct_file`); None: whichever way is faster on the staging
            folder's disk, measured before the first shard is written and kept there
            (:mod:`service.intake.write_mode`).
        deltas_per_keyframe: deltas one tensor ``gc(compress=True)`` stores whole may serve.
        reserve: disk kept for cleanup on a full disk, which saves never use (:mod:`service.db.reserve`).
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
        deltas_per_keyframe: int = 4,
        reserve: SpaceReserve | None = None,
    ) -> None:
        self.db = db
        self.deltas_per_keyframe = deltas_per_keyframe
        self.blobs = blobs
        self.staging_dir = Path(staging_dir)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self.max_header_bytes = max_header_bytes
        #: Where every shard enters (:class:`~service.intake.ingest.Intake`).
        self.reserve = reserve
        self.intake = Intake(
            db, blobs, self.staging_dir, max_header_bytes=max_header_bytes, direct_writes=direct_writes, reserve=reserve
        )

    @property
    def location(self) -> str:
        """Where this store keeps its data, for people: its database and blob store, secrets masked."""
        return f"{mask_url(self.db.url)} with blobs in {mask_url(self.blobs.location)}"

    @property
    def direct_writes(self) -> bool:
        """Whether shards are written around the page cache: as configured, else as measured
        (once per staging folder, then read from its cache) on the staging folder's disk."""
        return self.intake.direct_writes

    def prepare_writes(self) -> None:
        """Settle the write mode now (measured if unset) so the first save does not pay for it (on opening)."""
        _ = self.direct_writes

    @classmethod
    def open_home(cls, home: Path | str, *, direct_writes: bool | None = None) -> Store:
        """The embedded store in folder ``home``: ``metadata.db``, ``blobs/`` and ``staging/``;
        ``direct_writes`` defaults to the ``CKPTSTORE_DIRECT_WRITES`` setting (unset: measured)."""
        home = Path(home).expanduser()
        home.mkdir(parents=True, exist_ok=True)
        settings = Settings()
        direct = settings.direct_writes if direct_writes is None else direct_writes
        blobs, deltas = LocalBlobStore(home / "blobs"), settings.deltas_per_keyframe
        reserve = SpaceReserve.opening(home, settings.reserve_bytes)  # before SQLite opens: see service.db.reserve
        database = Database.sqlite_file(home / METADATA_FILE)
        return cls(database, blobs, home / "staging", direct_writes=direct, deltas_per_keyframe=deltas, reserve=reserve)

    def close(self) -> None:
        """Release database connections."""
        self.db.dispose()

    def clean_staging(self, older_than_seconds: float = STALE_SECONDS, *, now: float | None = None) -> CleanupReport:
        """Delete the temporary shard files no live process holds, left by killed clients or servers
        (:func:`service.reclaim.cleanup.clean_staging`; the age only judges where locks cannot)."""
        return clean_staging(self, older_than_seconds, now)

    # -- writing -------------------------------------------------------------------------

    def staging_path(self) -> Path:
        """A fresh, empty staging file to write a shard into for :meth:`ingest_file`, held till then."""
        return self.intake.held_staging_path()

    def missing(self, digests: Iterable[str], *, save_key: str | None = None) -> list[str]:
        """The digests among ``digests`` the store lacks, in input order; those present are stamped as seen
        now (gc spares them for its grace) and held till the save ``save_key`` names commits (holds)."""
        return lookup.find_missing(db=self.db, digests=digests, save_key=save_key)

    def sizes_held(self, sizes: Iterable[int]) -> set[int]:
        """Those of ``sizes`` (byte lengths) some stored tensor has: a save writes a tensor of another
        size at once, hashed as it is written, without asking (a hint; :func:`lookup.sizes_held`)."""
        return lookup.sizes_held(db=self.db, sizes=sizes)

    def ingest_file(self, path: Path, *, save_key: str | None = None) -> ShardReceipt:
        """Validate the shard at ``path``, store it and record its tensors (held for ``save_key``); idempotent.

        The file is consumed (moved into the blob store or deleted) whatever the outcome.

        Raises:
            InvalidShardError: the file is not a valid shard.
            IntegrityError: a tensor's bytes do not match its digest name.
            StorageError: garbage collection kept deleting the shard while it was stored; retry.
        """
        return self.intake.ingest_file(Path(path), save_key=save_key)

    def receiver(
        self, *, expected_id: str | None = None, max_bytes: int | None = None, write_behind: bool = False
    ) -> ShardReceiver:
        """A :class:`ShardReceiver` writing into this store's staging folder; pass it to :meth:`ingest_received`.

        ``write_behind`` writes on a background thread while the next bytes are hashed (HTTP
        saves 10-20 % faster; an embedded save, whose threads keep the cores busy, ~5 % slower).
        """
        return self.intake.receiver(expected_id=expected_id, max_bytes=max_bytes, write_behind=write_behind)

    def ingest_received(self, receiver: ShardReceiver, *, save_key: str | None = None) -> ShardReceipt:
        """Store the shard ``receiver`` took in whole (its bytes were hashed on the way); idempotent.
        The staging file is consumed whatever the outcome."""
        return self.intake.store_received(receiver, save_key=save_key)

    def put_shard(
        self, header: bytes, pieces: Sequence[memoryview], on_bytes: OnBytes = None, *, save_key: str | None = None
    ) -> ShardReceipt:
        """Store a shard given as its header bytes and its tensors' bytes in header order.

        Each piece is written to a staging file and hashed from the same memory, then the file
        is moved into the blob store: one write, one hash, nothing read back. ``on_bytes`` is
        called with each piece's size once it is written.
        """
        return self.intake.put_shard(header, pieces, on_bytes, save_key=save_key)

    def put_tensors(
        self, tensors: Sequence[UnhashedTensor], on_bytes: OnBytes = None, *, save_key: str | None = None
    ) -> tuple[ShardReceipt, list[str]]:
        """Store tensors whose digests the caller does not know as one shard; returns the receipt
        and each tensor's digest, in the order given.

        Each tensor is hashed from the memory it is written from (see :mod:`service.intake.shard_writer`),
        so nothing is hashed twice; tensors equal to one before them are written once.
        ``on_bytes`` is called with each tensor's size once it is written.
        """
        return self.intake.put_tensors(tensors, on_bytes, save_key=save_key)

    def _compaction_write(self, tensors: Sequence[UnhashedTensor]) -> tuple[ShardHeader, list[str]]:
        _receipt, written = self.intake.write_and_store(tensors)
        return written.header, written.digests

    @property
    def uploads(self) -> direct_uploads.StagedUploads:
        """Shard uploads clients send to the blob store directly (S3), verified here before they are
        stored: :meth:`~service.intake.direct_uploads.StagedUploads.start`, ``complete``, ``abort``."""
        return direct_uploads.StagedUploads(self.db, self.blobs, self.max_header_bytes)

    def commit(
        self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = (), commit_key: str | None = None
    ) -> VersionInfo:
        """Commit ``body`` as the next version of ``run_id`` (created if new), once for each
        ``commit_key`` (which releases the save's holds): :func:`service.catalog.commit.commit`."""
        from ckptstore.service.catalog.commit import commit

        return commit(self.db, run_id, body, tags=tags, commit_key=commit_key)

    # -- garbage collection --------------------------------------------------------------

    def gc(
        self,
        *,
        grace_seconds: int | None = None,
        dry_run: bool = False,
        orphans: bool = False,
        compact_below: float | None = None,
        compress: bool = False,
        now: datetime | None = None,
        on_bytes: Callable[[int], object] | None = None,
    ) -> GcReport:
        """Delete shards no committed version references, sparing recent ones; see :mod:`service.reclaim.gc`.

        ``grace_seconds`` (default one hour) spares shards recorded or reported present less than
        that long ago; ``orphans`` also deletes blobs no shard row names and unheld staging files; ``compress`` first
        re-encodes the tensors versions older than that added (:mod:`service.reclaim.compression`; each
        one's raw bytes then told to ``on_bytes``), then compacts below half unless told;
        ``compact_below`` rewrites shards whose live bytes are below that fraction (:mod:`service.reclaim.compaction`).
        """
        grace = DEFAULT_GRACE_SECONDS if grace_seconds is None else grace_seconds
        swept = clean_staging(self, grace, dry_run=dry_run) if orphans else None
        if compact_below is None and not compress:
            report = cleanup_with(
                None if dry_run else self.reserve,
                lambda: collect(self.db, self.blobs, grace_seconds=grace, dry_run=dry_run, orphans=orphans, now=now),
            )
            return with_staging_swept(report, swept)
        if self.reserve is not None and not dry_run:
            self.reserve.check_room_for_writes()  # rewriting takes room the reserve must not give
        from ckptstore.service.reclaim.compaction import compact_and_collect
        from ckptstore.service.reclaim.compression import COMPACT_AFTER_COMPRESSION, compressor

        deltas, staging, direct = self.deltas_per_keyframe, self.staging_dir, self.direct_writes
        compressing = compressor(self.db, self.blobs, staging, deltas, dry_run, on_bytes, direct) if compress else None
        compact_below = COMPACT_AFTER_COMPRESSION if compress and compact_below is None else compact_below
        report = compact_and_collect(
            db=self.db, blobs=self.blobs, write=self._compaction_write, below=compact_below,
            grace_seconds=grace, dry_run=dry_run, orphans=orphans, now=now, compress=compressing, staging=staging,
        )  # fmt: skip
        return with_staging_swept(report, swept)

    # -- reading -------------------------------------------------------------------------

    def resolve(self, run_id: str, ref: int | str = LATEST) -> int:
        """The version number that ``ref`` (a number, 'latest' or a tag) names in ``run_id``."""
        with self.db.transaction() as session:
            return resolve_ref(session, validate_run_id(run_id), ref)

    def manifest(self, run_id: str, ref: int | str = LATEST) -> Manifest:
        """The manifest of the version ``ref`` names."""
        from ckptstore.service.format.manifest import manifest_from_json

        with self.db.transaction() as session:
            version = resolve_ref(session, validate_run_id(run_id), ref)
            return manifest_from_json(manifest_text(session, run_id, version))

    def check_metadata(self, run_id: str, ref: int | str = LATEST) -> list[MetadataProblem]:
        """What differs in the stored metadata of the version ``ref`` names from the digests covering it."""
        return check_metadata(db=self.db, run_id=run_id, ref=ref)

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes live; NotFoundError names any the store lacks."""
        return lookup.locate(db=self.db, digests=digests)

    def read_tensor(self, digest: str) -> bytearray:
        """A stored tensor's raw bytes, decoded if it is stored encoded, checked against its digest."""
        return read_tensor(self.blobs.read_into, self.locate([digest]), digest)

    def read_urls(self, shard_ids: Iterable[str], expires_seconds: int) -> dict[str, str]:
        """URLs to read each shard from directly for ``expires_seconds`` where the blob store signs
        them (S3; no request made), else empty. A URL of a shard not held reads nothing."""
        wanted = [_shard_id(shard_id) for shard_id in dict.fromkeys(shard_ids)]
        return self.blobs.read_urls(wanted, expires_seconds) if expires_seconds > 0 else {}

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from shard ``shard_id`` starting at byte ``offset``."""
        self.blobs.read_into(_shard_id(shard_id), offset, buffer)

    def read_scatter(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn with shard ``shard_id``'s consecutive bytes from ``offset``."""
        self.blobs.read_scatter(_shard_id(shard_id), offset, buffers)

    def will_read(self, shard_id: str, spans: Sequence[tuple[int, int]]) -> None:
        """A hint that ``(offset, length)`` spans of a shard will be read soon (:meth:`BlobStore.will_read`)."""
        self.blobs.will_read(_shard_id(shard_id), spans)

    def shard_size(self, shard_id: str) -> int:
        """Size in bytes of a stored shard; NotFoundError if absent."""
        size = self.blobs.size(_shard_id(shard_id))
        if size is None:
            raise NotFoundError(f"shard {shard_id} is not in the store")
        return size

    def iter_shard(
        self, shard_id: str, offset: int, length: int, chunk_bytes: int = READ_CHUNK_BYTES
    ) -> Iterator[bytes | memoryview]:
        """Stream ``length`` bytes of a shard from ``offset``, in pieces of ``chunk_bytes`` (the last shorter)."""
        return self.blobs.iter_range(_shard_id(shard_id), offset, length, chunk_bytes)

    def ping(self) -> None:
        """Raise StorageError unless the metadata database answers."""
        with self.db.transaction() as session:
            session.execute(select(1))

    def runs(self) -> list[RunInfo]:
        """Every run with its totals, most recently updated first."""
        return list_runs(db=self.db)

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of ``run_id``, oldest first (summary columns only, no manifest is read)."""
        return list_versions(db=self.db, run_id=validate_run_id(run_id))

    def version(self, run_id: str, ref: int | str = LATEST) -> VersionInfo:
        """The summary of the one version ``ref`` names."""
        return version_summary(db=self.db, run_id=validate_run_id(run_id), ref=ref)

    def runs_overview(self) -> list[tuple[RunInfo, VersionInfo | None, list[tuple[str, int]]]]:
        """Every run (as :meth:`runs`) with its newest version and its tags as ``(name, version)``
        pairs: three statements whatever the number of runs, and no manifest read."""
        return overview(db=self.db)

    # -- tags and deletion ---------------------------------------------------------------

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        return set_tag(db=self.db, run_id=run_id, ref=ref, name=name)

    def untag(self, run_id: str, name: str) -> None:
        """Remove tag ``name`` from ``run_id`` (a reserved name too, should a store hold one)."""
        cleanup_with(self.reserve, lambda: remove_tag(db=self.db, run_id=run_id, name=name))

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete one version (its tags go with it); its blobs stay until garbage collection."""
        return cleanup_with(self.reserve, lambda: remove_version(db=self.db, run_id=run_id, ref=ref))

    # -- retention -----------------------------------------------------------------------

    def get_retention(self, run_id: str) -> RetentionPolicy:
        """The run's retention policy and the versions it would remove now (NotFoundError if no run)."""
        return current_policy(db=self.db, run_id=validate_run_id(run_id))

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
        """Replace the run's retention policy, applied at each commit from the next (see
        :func:`service.catalog.retention.replace_policy`); nothing is removed now (:meth:`apply_retention`
        does). A run that does not exist is created only with ``create_run``, as a save does."""
        validate_run_id(run_id)
        policy = check_policy(keep_last, keep_best, metric, mode)
        return replace_policy(db=self.db, run_id=run_id, policy=policy, create_run=create_run)

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now the versions the run's policy does not keep; returns their numbers."""
        return cleanup_with(self.reserve, lambda: apply_now(db=self.db, run_id=validate_run_id(run_id)))


def _shard_id(shard_id: str) -> str:
    """``shard_id``, once it is seen to be one (InvalidInputError otherwise)."""
    if not is_digest(shard_id):
        raise InvalidInputError(f"{shard_id[:80]!r} is not a shard id")
    return shard_id


__all__ = ["Store"]
