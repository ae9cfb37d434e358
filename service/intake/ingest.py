"""Storing shards: check a shard file, move it into the blob store, record its tensors.

A shard enters once, through :class:`Intake`, and every way it arrives ends in the same step:
a file on disk (:meth:`Intake.ingest_file`, hashed here by :func:`verify_shard_file`), bytes
hashed as they were received (:class:`~service.intake.receiver.ShardReceiver`), or tensors hashed
as they were written (:meth:`Intake.write_and_store`). The blob goes in first and its rows after,
under the collection lock in share mode (:mod:`service.db.lock`), so a version can only ever
reference stored bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, select

from ckptstore.service.blobs import BlobStore
from ckptstore.service.blobs.held_file import HeldFile, hold_new
from ckptstore.service.db import Database, holds
from ckptstore.service.db.lock import hold_shared
from ckptstore.service.db.models import Shard, Tensor, utcnow
from ckptstore.service.db.reserve import SpaceReserve
from ckptstore.service.db.session import insert_columns, insert_new
from ckptstore.service.errors import IntegrityError, InvalidInputError, InvalidShardError, StorageError
from ckptstore.service.format.digest import TensorHasher
from ckptstore.service.format.dtypes import DTYPES, byte_length
from ckptstore.service.format.names import validate_commit_key
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES, ShardHeader, layout_order, read_header
from ckptstore.service.format.sharding import SHARD_METADATA, UnhashedTensor
from ckptstore.service.intake.receiver import ShardReceiver, staging_error
from ckptstore.service.intake.shard_writer import WrittenShard, write_shard
from ckptstore.service.intake.unhashed_receiver import UnhashedReceiver
from ckptstore.service.intake.write_mode import choose_direct_writes

#: A shard re-uploaded while a sweep deletes it is stored again; this many tries at most.
INGEST_ATTEMPTS = 3
_SHARD_KNOWN = select(Shard.id).where(Shard.id == bindparam("shard_id"))


def verify_shard_file(path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES) -> ShardHeader:
    """Validate the shard at ``path`` and hash every tensor against its digest name.

    Raises:
        InvalidShardError: the file breaks a header or layout rule.
        IntegrityError: a tensor's bytes do not match the digest it is stored under.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        header = read_header(handle, size, max_header_bytes=max_header_bytes)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for entry in header.entries:
                    hasher = TensorHasher(entry.dtype, entry.shape)
                    hasher.update(view[header.data_start + entry.begin : header.data_start + entry.end])
                    actual = hasher.hexdigest()
                    if actual != entry.digest:
                        raise IntegrityError(
                            f"shard tensor {entry.digest[:16]}… hashes to {actual[:16]}…: its bytes were "
                            "changed or cut in transit; retry the save (stored tensors are not sent again)"
                        )
            finally:
                view.release()
    return header


def check_unhashed(tensors: Sequence[UnhashedTensor]) -> None:
    """Raise InvalidInputError unless ``tensors`` are some tensors, each of a known dtype, whole and not empty."""
    if not tensors:
        raise InvalidInputError("no tensors to store")
    for tensor in tensors:
        if tensor.dtype not in DTYPES or tensor.data.nbytes != byte_length(tensor.dtype, tensor.shape):
            shape = list(tensor.shape)
            raise InvalidInputError(f"{tensor.data.nbytes} bytes are not a tensor of {tensor.dtype}{shape}")
        if tensor.data.nbytes == 0:
            raise InvalidInputError("an empty tensor needs no storage; leave it out")


class Intake:
    """The one way into the store for a shard, holding what every step needs: the database, the
    blob store, the staging folder, the header cap and the write mode.

    However a shard arrives (a file on disk, bytes hashed as they are received, or tensors hashed
    as they are written) it ends in :meth:`_store`: the blob goes in first and its rows after.
    """

    def __init__(
        self,
        db: Database,
        blobs: BlobStore,
        staging_dir: Path,
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        direct_writes: bool | None = True,
        reserve: SpaceReserve | None = None,
    ) -> None:
        self.db = db
        self.blobs = blobs
        self.staging_dir = staging_dir
        #: Room kept for cleanup: a staging file is not made while the disk lacks it (StorageFullError).
        self.reserve = reserve
        self.max_header_bytes = max_header_bytes
        self._direct_writes = direct_writes
        self._direct_lock = threading.Lock()
        self._handed_out: dict[Path, HeldFile] = {}  # staging files made for callers, held until ingested
        self._handed_lock = threading.Lock()

    @property
    def direct_writes(self) -> bool:
        """Whether shards are written around the page cache: as configured, else as measured
        (once per staging folder, then read from its cache) on the staging folder's disk."""
        if self._direct_writes is None:
            with self._direct_lock:
                if self._direct_writes is None:
                    self._direct_writes = choose_direct_writes(self.staging_dir).direct
        return self._direct_writes

    def staging_path(self) -> Path:
        """A fresh path in the staging folder for a shard being written or received (once the disk
        has room for it beside the :attr:`reserve`)."""
        if self.reserve is not None:
            self.reserve.check_room_for_writes()
        return self.staging_dir / f"{uuid.uuid4().hex}.incomplete"

    def held_staging_path(self) -> Path:
        """A fresh, empty file in the staging folder for the caller to write a shard into (opened
        without ``O_EXCL``: it exists) and pass to :meth:`ingest_file`; this process holds it until
        then, so a sweep of the staging folder leaves it be."""
        held = hold_new(self.staging_path())
        with self._handed_lock:
            self._handed_out[held.path] = held
        return held.path

    # -- a file on disk ------------------------------------------------------------------------

    def ingest_file(self, path: Path, *, save_key: str | None = None) -> ShardReceipt:
        """Validate the shard at ``path``, store it and record its tensors; see :meth:`Store.ingest_file`.

        The file is consumed (moved into the blob store or deleted) whatever the outcome. Its
        tensors are hashed only if the shard is not stored yet. ``save_key``: the save it is
        part of, which holds its tensors until it commits (:mod:`service.db.holds`).
        """
        with self._handed_lock:
            held = self._handed_out.pop(Path(path), None)
        try:
            with open(path, "rb") as handle:
                header = read_header(handle, path.stat().st_size, max_header_bytes=self.max_header_bytes)
            verified = False

            def verify() -> None:
                nonlocal verified
                if not verified:
                    verify_shard_file(path, max_header_bytes=self.max_header_bytes)
                    verified = True

            return self._store(path, header, verify, save_key)
        finally:
            path.unlink(missing_ok=True)
            if held is not None:
                held.release()

    # -- bytes hashed as they are received -------------------------------------------------------

    def receiver(
        self, *, expected_id: str | None = None, max_bytes: int | None = None, write_behind: bool = False
    ) -> ShardReceiver:
        """A :class:`ShardReceiver` writing into the staging folder; pass it to :meth:`store_received`."""
        return ShardReceiver(
            self.staging_path(),
            expected_id=expected_id,
            max_bytes=max_bytes,
            max_header_bytes=self.max_header_bytes,
            direct_writes=self.direct_writes,
            write_behind=write_behind,
        )

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> ShardReceipt:
        """Write a shard's ``header`` and then its ``pieces`` through a receiver, and store it.

        ``on_bytes`` is called with each piece's size once it is written; ``save_key`` as for
        :meth:`ingest_file`.
        """
        receiver = self.receiver()
        try:
            receiver.write(header)
            receiver.write_tensors(pieces, on_bytes)
        except BaseException:
            receiver.discard()
            raise
        return self.store_received(receiver, save_key=save_key)

    def store_received(self, receiver: ShardReceiver, *, save_key: str | None = None) -> ShardReceipt:
        """Store the shard ``receiver`` took in whole; its bytes were hashed on their way in, so
        nothing is read back. The staging file is consumed whatever the outcome; ``save_key`` as
        for :meth:`ingest_file`."""
        try:
            return self._store(receiver.path, receiver.finish(), _verified, save_key)
        finally:
            receiver.discard()

    def unhashed_receiver(self, *, length: int, max_bytes: int) -> UnhashedReceiver:
        """A receiver for an upload of tensors not hashed yet (:mod:`service.intake.unhashed_receiver`),
        ``length`` bytes whose tensors hold at most ``max_bytes``; pass it to :meth:`store_unhashed`."""
        return UnhashedReceiver(
            self.staging_path(),
            length=length,
            max_bytes=max_bytes,
            max_layout_bytes=self.max_header_bytes,
            direct_writes=self.direct_writes,
        )

    def store_unhashed(
        self, receiver: UnhashedReceiver, *, save_key: str | None = None
    ) -> tuple[ShardReceipt, list[str]]:
        """Store the upload ``receiver`` took in whole; the receipt and each tensor's digest in the
        order sent. The staging file is consumed whatever the outcome; ``save_key`` as for
        :meth:`ingest_file`."""
        try:
            written = receiver.finish()
            return self._store(receiver.path, written.header, _verified, save_key), written.digests
        finally:
            receiver.discard()

    # -- tensors hashed as they are written ------------------------------------------------------

    def put_tensors(
        self,
        tensors: Sequence[UnhashedTensor],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> tuple[ShardReceipt, list[str]]:
        """Store ``tensors`` as one shard laid out by dtype; the receipt and each tensor's digest, in
        the order given; see :meth:`Store.put_tensors`."""
        check_unhashed(tensors)
        order = layout_order([tensor.dtype for tensor in tensors])
        receipt, written = self.write_and_store([tensors[i] for i in order], on_bytes, save_key=save_key)
        digests = [""] * len(tensors)
        for index, digest in zip(order, written.digests, strict=True):
            digests[index] = digest
        return receipt, digests

    def write_and_store(
        self,
        tensors: Sequence[UnhashedTensor],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> tuple[ShardReceipt, WrittenShard]:
        """Write ``tensors``, in the order given, as one shard, hashing each, and store it.

        ``on_bytes`` is called with each tensor's size once it is written; ``save_key`` as for
        :meth:`ingest_file`.
        """
        try:
            held = hold_new(self.staging_path())  # held, so a sweep of the staging folder leaves it be
        except OSError as exc:
            raise staging_error(exc) from exc
        with held:
            written = write_shard(
                held.path, tensors, SHARD_METADATA, direct_writes=self.direct_writes, on_bytes=on_bytes, exists=True
            )
            return self._store(held.path, written.header, _verified, save_key), written

    # -- where every way ends --------------------------------------------------------------------

    def _store(self, path: Path, header: ShardHeader, verify: Callable[[], None], save_key: str | None) -> ShardReceipt:
        """Move a validated shard file into the blob store and record it (held for ``save_key``);
        ``verify`` runs first if it is new.

        Raises:
            StorageError: garbage collection kept deleting the shard while it was stored; retry.
            InvalidNameError: ``save_key`` is not a commit key.
        """
        if save_key is not None:
            validate_commit_key(save_key)
        for _attempt in range(INGEST_ATTEMPTS):
            with self.db.transaction() as session:
                known = session.connection().execute(_SHARD_KNOWN, {"shard_id": header.shard_id}).first() is not None
            if not known:
                # Only a shard not yet stored is hashed: a known id names bytes already verified.
                verify()
                self.blobs.put_file(header.shard_id, path)
            created = record_shard(db=self.db, blobs=self.blobs, header=header, save_key=save_key)
            if created is not None:
                return ShardReceipt(
                    shard_id=header.shard_id, size=header.file_size, tensors=len(header.entries), created=created
                )
            if not path.exists():  # the blob store took the file, and a sweep then deleted it
                break
        raise StorageError(
            f"shard {header.shard_id} was deleted by garbage collection while it was being stored; retry the upload"
        )


def _verified() -> None:
    """The check of a shard whose bytes were hashed as they arrived or were written: nothing left."""


def record_shard(*, db: Database, blobs: BlobStore, header: ShardHeader, save_key: str | None = None) -> bool | None:
    """Record the shard and its tensors not stored elsewhere, held for the save ``save_key`` names
    until it commits (:mod:`service.db.holds`); whether the shard row is new.

    None (and nothing recorded) if the blob is gone: a sweep deleted it after this shard
    was found stored or put in place. The check runs under the collection lock, so a sweep
    cannot delete the blob between it and the commit of the rows.

    Concurrent ingests of the same shard, or of shards sharing tensors, all succeed: rows
    already there (or being inserted by another transaction) are skipped, so a tensor keeps
    its first location. Tensors go in digest order so two ingests never deadlock. A known
    shard's tensors are recorded too: a sweep may have removed their rows where they were
    first stored, and this shard's bytes were verified when it was first stored.
    """
    shard_id = header.shard_id
    by_digest = {entry.digest: entry for entry in header.entries}
    entries = [by_digest[digest] for digest in sorted(by_digest)]
    start = header.data_start
    columns: dict[str, Sequence[Any]] = {
        "digest": [entry.digest for entry in entries],
        "shard_id": [shard_id] * len(entries),
        "dtype": [entry.dtype for entry in entries],
        "shape": [entry.shape for entry in entries],
        "offset": [start + entry.begin for entry in entries],
        "nbytes": [entry.end - entry.begin for entry in entries],
    }
    try:
        with db.transaction() as session:
            hold_shared(session)
            if save_key is not None:
                holds.renew(session, save_key, utcnow())
            created = insert_new(session, Shard, {"id": shard_id, "size": header.file_size})
            insert_columns(session, Tensor, columns)
            if save_key is not None:
                holds.hold(session, save_key, columns["digest"])
            if blobs.size(shard_id) is None:
                raise _BlobSwept
            return created
    except _BlobSwept:
        return None


class _BlobSwept(Exception):
    """A shard's blob vanished before its rows were recorded (rolls the recording back)."""


__all__ = [
    "INGEST_ATTEMPTS",
    "Intake",
    "InvalidShardError",
    "check_unhashed",
    "record_shard",
    "verify_shard_file",
]
