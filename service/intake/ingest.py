"""Storing shards: check a shard file, move it into the blob store, record its tensors.

Every way a shard arrives ends in :func:`store_shard`: a file on disk (:func:`ingest_file`,
hashed here by :func:`verify_shard_file`), bytes hashed as they were received
(:class:`~service.intake.receiver.ShardReceiver`), or tensors hashed as they were written
(:func:`write_tensors`). The blob goes in first and its rows after, under the collection lock
in share mode (:mod:`service.db.lock`), so a version can only ever reference stored bytes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, select

from ckptstore.service.blobs import BlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.lock import hold_shared
from ckptstore.service.db.models import Shard, Tensor
from ckptstore.service.db.session import insert_columns, insert_new
from ckptstore.service.errors import IntegrityError, InvalidInputError, InvalidShardError, StorageError
from ckptstore.service.format.digest import TensorHasher
from ckptstore.service.format.dtypes import DTYPES, byte_length
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES, ShardHeader, layout_order, read_header
from ckptstore.service.format.sharding import SHARD_METADATA, UnhashedTensor
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.intake.shard_writer import WrittenShard, write_shard
from ckptstore.service.intake.unhashed_receiver import UnhashedReceiver

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


def ingest_file(*, db: Database, blobs: BlobStore, path: Path, max_header_bytes: int) -> ShardReceipt:
    """Validate the shard at ``path``, store it and record its tensors; see :meth:`Store.ingest_file`.

    The file is consumed (moved into the blob store or deleted) whatever the outcome. Its
    tensors are hashed only if the shard is not stored yet.
    """
    try:
        with open(path, "rb") as handle:
            header = read_header(handle, path.stat().st_size, max_header_bytes=max_header_bytes)
        verified = False

        def verify() -> None:
            nonlocal verified
            if not verified:
                verify_shard_file(path, max_header_bytes=max_header_bytes)
                verified = True

        return store_shard(db=db, blobs=blobs, path=path, header=header, verify=verify)
    finally:
        path.unlink(missing_ok=True)


def store_received(*, db: Database, blobs: BlobStore, receiver: ShardReceiver) -> ShardReceipt:
    """Store the shard ``receiver`` took in whole; see :meth:`Store.ingest_received`.

    Its bytes were hashed on their way in, so nothing is read back. The staging file is
    consumed whatever the outcome.
    """
    try:
        header = receiver.finish()
        return store_shard(db=db, blobs=blobs, path=receiver.path, header=header, verify=lambda: None)
    finally:
        receiver.discard()


@dataclass(frozen=True)
class UnhashedUploads:
    """Uploads of tensors not hashed yet into one store (:mod:`service.intake.unhashed_receiver`)."""

    db: Database
    blobs: BlobStore
    staging_path: Callable[[], Path]
    direct_writes: bool
    max_layout_bytes: int

    def receiver(self, *, length: int, max_bytes: int) -> UnhashedReceiver:
        """A receiver for an upload of ``length`` bytes whose tensors hold at most ``max_bytes``,
        staged in the store's folder; pass it to :meth:`ingest`."""
        return UnhashedReceiver(
            self.staging_path(),
            length=length,
            max_bytes=max_bytes,
            max_layout_bytes=self.max_layout_bytes,
            direct_writes=self.direct_writes,
        )

    def ingest(self, receiver: UnhashedReceiver) -> tuple[ShardReceipt, list[str]]:
        """Store the upload ``receiver`` took in whole; the receipt and each tensor's digest in the
        order sent. The staging file is consumed whatever the outcome."""
        try:
            written = receiver.finish()
            header = written.header
            receipt = store_shard(db=self.db, blobs=self.blobs, path=receiver.path, header=header, verify=lambda: None)
            return receipt, written.digests
        finally:
            receiver.discard()


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


def put_tensors(
    *,
    db: Database,
    blobs: BlobStore,
    path: Path,
    tensors: Sequence[UnhashedTensor],
    direct_writes: bool,
    on_bytes: Callable[[int], object] | None = None,
) -> tuple[ShardReceipt, list[str]]:
    """Store ``tensors`` (passed by :func:`check_unhashed`) as one shard at ``path``, laid out by dtype.

    Returns the receipt and each tensor's digest, in the order given; see :meth:`Store.put_tensors`.
    """
    order = layout_order([tensor.dtype for tensor in tensors])
    receipt, written = write_tensors(
        db=db,
        blobs=blobs,
        path=path,
        tensors=[tensors[i] for i in order],
        direct_writes=direct_writes,
        on_bytes=on_bytes,
    )
    digests = [""] * len(tensors)
    for index, digest in zip(order, written.digests, strict=True):
        digests[index] = digest
    return receipt, digests


def fill(
    receiver: ShardReceiver, header: bytes, pieces: Sequence[memoryview], on_bytes: Callable[[int], object] | None
) -> ShardReceiver:
    """Write a shard's ``header`` and then its ``pieces`` into ``receiver``; ``receiver``.

    ``on_bytes`` is called with each piece's size once it is written. On any error the
    receiver's staging file is removed.
    """
    try:
        receiver.write(header)
        receiver.write_tensors(pieces, on_bytes)
    except BaseException:
        receiver.discard()
        raise
    return receiver


def write_tensors(
    *,
    db: Database,
    blobs: BlobStore,
    path: Path,
    tensors: Sequence[UnhashedTensor],
    direct_writes: bool,
    on_bytes: Callable[[int], object] | None = None,
) -> tuple[ShardReceipt, WrittenShard]:
    """Write ``tensors``, in the order given, as one shard at ``path``, hashing each, and store it.

    ``on_bytes`` is called with each tensor's size once it is written; ``path`` is gone after.
    """
    try:
        written = write_shard(path, tensors, SHARD_METADATA, direct_writes=direct_writes, on_bytes=on_bytes)
        return store_shard(db=db, blobs=blobs, path=path, header=written.header, verify=lambda: None), written
    finally:
        path.unlink(missing_ok=True)


def store_shard(
    *, db: Database, blobs: BlobStore, path: Path, header: ShardHeader, verify: Callable[[], None]
) -> ShardReceipt:
    """Move a validated shard file into the blob store and record it; ``verify`` runs first if it is new.

    Raises:
        StorageError: garbage collection kept deleting the shard while it was stored; retry.
    """
    for _attempt in range(INGEST_ATTEMPTS):
        with db.transaction() as session:
            known = session.connection().execute(_SHARD_KNOWN, {"shard_id": header.shard_id}).first() is not None
        if not known:
            # Only a shard not yet stored is hashed: a known id names bytes already verified.
            verify()
            blobs.put_file(header.shard_id, path)
        created = record_shard(db=db, blobs=blobs, header=header)
        if created is not None:
            return ShardReceipt(
                shard_id=header.shard_id, size=header.file_size, tensors=len(header.entries), created=created
            )
        if not path.exists():  # the blob store took the file, and a sweep then deleted it
            break
    raise StorageError(
        f"shard {header.shard_id} was deleted by garbage collection while it was being stored; retry the upload"
    )


def record_shard(*, db: Database, blobs: BlobStore, header: ShardHeader) -> bool | None:
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
            created = insert_new(session, Shard, {"id": shard_id, "size": header.file_size})
            insert_columns(session, Tensor, columns)
            if blobs.size(shard_id) is None:
                raise _BlobSwept
            return created
    except _BlobSwept:
        return None


class _BlobSwept(Exception):
    """A shard's blob vanished before its rows were recorded (rolls the recording back)."""


__all__ = [
    "INGEST_ATTEMPTS",
    "InvalidShardError",
    "check_unhashed",
    "fill",
    "ingest_file",
    "put_tensors",
    "record_shard",
    "store_received",
    "store_shard",
    "UnhashedUploads",
    "verify_shard_file",
    "write_tensors",
]
