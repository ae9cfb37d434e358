"""Shards clients upload to the blob store themselves (S3): the server signs, verifies, publishes, records.

Where the blobs live in S3, a client need not send a shard's bytes through the server:

1. :func:`start_upload` (``POST /v1/shards/<id>/uploads``, write scope): the blob store's
   staging area (:meth:`service.blobs.BlobStore.staging`) picks a staging key of its own, never
   the blob's, and signs ``PUT`` URLs for it (a multipart upload above the store's part size),
   valid for ``upload_url_seconds``. Bounded as a proxied upload is: ``max_shard_bytes``, S3's
   part count, the URL lifetime.
2. The client ``PUT``s the bytes to the URLs, straight to S3.
3. :func:`complete_upload` (``POST /v1/shards/<id>/uploads/<token>``): the server completes the
   multipart upload (after checking every planned part is there, of its planned size), seals
   it (copies it inside S3 to a key of this completion's own that no client can write:
   :meth:`service.blobs.base.StagingArea.seal`), reads the sealed copy back and checks it
   exactly as a proxied upload is checked (:class:`service.intake.receiver.ShardVerifier`: header,
   shard id, size, every tensor's digest), copies that same sealed copy to the blob key inside
   S3, records it as :func:`service.intake.ingest.store_shard` does, and deletes the sealed copy and
   the staged object.

So nothing a client uploads is referenced by a version, or offered to other saves by
:meth:`Store.missing`, before it is verified, and what is referenced is exactly what was
verified: its tensor rows are written only after the check, only from the verified header, and
the blob is copied from the sealed copy, never from the staged key, which the client's URL can
still overwrite until it expires (a swap during the check changes nothing the server reads).

A refused upload (wrong id, bytes that do not match their digests, a missing part) has its
staged object deleted and answers 4xx naming the problem; one that fails on S3's side (503) is
left staged for the client's retry, and garbage collection removes it if none comes
(:meth:`service.blobs.base.StagingArea.sweep`).

Verification reads the sealed copy once and writes nothing: a verify-only receiver rather than
:class:`service.intake.receiver.ShardReceiver` with a temporary file (of no use after: the blob is
copied inside S3). Measured on a 256 MiB shard (two tensors) read back from a local moto S3
server on a 2-core VM, three runs: verifying only 0.34-0.35 s (0.12-0.13 s of the verifying
thread's CPU), through a ShardReceiver writing a temporary file 0.44-0.46 s (0.16-0.17 s, plus its
writer thread's); the hashing itself 0.06-0.07 s. Any replica of the server can complete
any upload: the staging key is rebuilt from the shard id and the token, nothing is kept between
the two calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from ckptstore.service.blobs import BlobStore
from ckptstore.service.blobs.base import StagingArea, UploadPlan, check_blob_id, check_staging_token
from ckptstore.service.db import Database, holds
from ckptstore.service.db.lock import hold_shared
from ckptstore.service.db.models import Shard, Tensor, utcnow
from ckptstore.service.errors import (
    DirectUploadsUnavailableError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    PayloadTooLargeError,
    StorageError,
)
from ckptstore.service.format.names import validate_commit_key
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES, PREFIX_BYTES, ShardHeader
from ckptstore.service.intake.ingest import INGEST_ATTEMPTS, record_shard
from ckptstore.service.intake.receiver import ShardVerifier

#: Pieces the staged object is read back in for verification.
VERIFY_CHUNK_BYTES = 8 << 20
#: The refusals that end an upload for good: its staged object is deleted.
_FINAL = (InvalidInputError, IntegrityError, PayloadTooLargeError, NotFoundError)


def staging_area(blobs: BlobStore, expires_seconds: int = 1) -> StagingArea:
    """The blob store's staging area.

    Raises:
        DirectUploadsUnavailableError: the blob store has none, or ``expires_seconds`` is 0 (turned off).
    """
    area = blobs.staging() if expires_seconds > 0 else None
    if area is None:
        raise DirectUploadsUnavailableError(
            "this server takes shard uploads only through itself (its blobs are not in S3, or "
            "CKPTSTORE_UPLOAD_URL_SECONDS is 0): send the shard with PUT /v1/shards/<shard id>"
        )
    return area


def start_upload(*, blobs: BlobStore, shard_id: str, size: int, max_bytes: int, expires_seconds: int) -> UploadPlan:
    """Stage an upload of shard ``shard_id`` (``size`` bytes) and sign its URLs; see the module docstring.

    Raises:
        DirectUploadsUnavailableError: the server takes no direct uploads.
        InvalidInputError: ``shard_id`` is not a shard id, or ``size`` is too small for a shard.
        PayloadTooLargeError: ``size`` is above ``max_bytes``.
        StorageError: S3 failed.
    """
    area = staging_area(blobs, expires_seconds)
    _check_shard_id(shard_id)
    if isinstance(size, bool) or not isinstance(size, int) or size < PREFIX_BYTES:
        raise InvalidInputError(f"a shard has at least {PREFIX_BYTES} bytes, not {size!r}")
    if size > max_bytes:
        raise PayloadTooLargeError(f"shard of {size} bytes exceeds the limit of {max_bytes}")
    return area.plan(shard_id, size, expires_seconds)


def complete_upload(
    *,
    db: Database,
    blobs: BlobStore,
    shard_id: str,
    token: str,
    size: int,
    max_bytes: int,
    max_header_bytes: int = MAX_HEADER_BYTES,
    save_key: str | None = None,
) -> ShardReceipt:
    """Finish, verify, publish and record the staged upload ``token`` of shard ``shard_id``, its
    tensors held for the save ``save_key`` names until it commits (:mod:`service.db.holds`).

    Idempotent: asked again after it succeeded (an answer lost on the way), it answers the
    stored shard's receipt with ``created`` False.

    Raises:
        DirectUploadsUnavailableError: the server takes no direct uploads.
        NotFoundError: nothing is staged under ``token`` and the shard is not stored.
        InvalidInputError: a part is missing or of the wrong size, or the shard is malformed.
        IntegrityError: the shard's id or a tensor's bytes do not match (nothing is stored).
        PayloadTooLargeError: the staged object is larger than ``max_bytes``.
        StorageError: S3 or the database failed; the staged upload is kept for a retry.
    """
    area = staging_area(blobs)
    _check_shard_id(shard_id)
    check_staging_token(token)
    if save_key is not None:
        validate_commit_key(save_key)
    try:
        staged = area.finish(shard_id, token, size)
    except NotFoundError:
        stored = _stored_receipt(db, blobs, shard_id, save_key)
        if stored is not None:
            return stored
        raise
    except _FINAL:
        _remove_quietly(area, shard_id, token)
        raise
    try:
        if staged > max_bytes:
            raise PayloadTooLargeError(f"shard of {staged} bytes exceeds the limit of {max_bytes}")
        seal = area.seal(shard_id, token, staged)
        try:
            header = verify_staged(area, shard_id, token, seal, max_bytes=max_bytes, max_header_bytes=max_header_bytes)
            receipt = _publish_and_record(db, blobs, area, header, token, seal, save_key)
        finally:
            _unseal_quietly(area, shard_id, token, seal)
    except _FINAL:
        _remove_quietly(area, shard_id, token)
        raise
    _remove_quietly(area, shard_id, token)
    return receipt


def abort_upload(*, blobs: BlobStore, shard_id: str, token: str) -> None:
    """Remove the staged upload ``token`` of ``shard_id`` (a client that gave up on it); idempotent."""
    area = staging_area(blobs)
    _check_shard_id(shard_id)
    area.remove(shard_id, check_staging_token(token))


def verify_staged(
    area: StagingArea,
    shard_id: str,
    token: str,
    seal: str,
    *,
    max_bytes: int,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> ShardHeader:
    """Read the sealed copy of a staged upload back and check it as a proxied upload is checked; its
    verified header.

    Raises:
        IntegrityError: the header's id is not ``shard_id``, or a tensor's bytes do not match its digest.
        InvalidShardError: the header is malformed, or the object is cut short or too long.
        PayloadTooLargeError: the shard is larger than ``max_bytes``.
    """
    verifier = ShardVerifier(expected_id=shard_id, max_bytes=max_bytes, max_header_bytes=max_header_bytes)
    for piece in area.read(shard_id, token, seal, VERIFY_CHUNK_BYTES):
        verifier.write(piece)
    return verifier.finish()


@dataclass(frozen=True)
class StagedUploads:
    """The direct uploads of one store (:attr:`service.store.Store.uploads`): the functions above
    over its database and blob store."""

    db: Database
    blobs: BlobStore
    max_header_bytes: int = MAX_HEADER_BYTES

    def start(self, shard_id: str, size: int, *, max_bytes: int, expires_seconds: int) -> UploadPlan:
        """:func:`start_upload`: stage an upload and sign its URLs."""
        return start_upload(
            blobs=self.blobs, shard_id=shard_id, size=size, max_bytes=max_bytes, expires_seconds=expires_seconds
        )

    def complete(
        self, shard_id: str, token: str, size: int, *, max_bytes: int, save_key: str | None = None
    ) -> ShardReceipt:
        """:func:`complete_upload`: finish, verify, publish and record a staged upload (held for
        ``save_key``); idempotent."""
        return complete_upload(
            db=self.db,
            blobs=self.blobs,
            shard_id=shard_id,
            token=token,
            size=size,
            max_bytes=max_bytes,
            max_header_bytes=self.max_header_bytes,
            save_key=save_key,
        )

    def abort(self, shard_id: str, token: str) -> None:
        """:func:`abort_upload`: remove a staged upload a client gave up on; idempotent."""
        abort_upload(blobs=self.blobs, shard_id=shard_id, token=token)


def _publish_and_record(
    db: Database, blobs: BlobStore, area: StagingArea, header: ShardHeader, token: str, seal: str, save_key: str | None
) -> ShardReceipt:
    """Copy the verified sealed copy to its blob key and record the shard, as
    :func:`service.intake.ingest.store_shard` stores a verified file (again if a sweep took the blob meanwhile)."""
    for _attempt in range(INGEST_ATTEMPTS):
        area.publish(header.shard_id, token, seal, header.file_size)
        created = record_shard(db=db, blobs=blobs, header=header, save_key=save_key)
        if created is not None:
            return ShardReceipt(
                shard_id=header.shard_id, size=header.file_size, tensors=len(header.entries), created=created
            )
    raise StorageError(
        f"shard {header.shard_id} was deleted by garbage collection while it was being stored; retry the upload"
    )


def _stored_receipt(db: Database, blobs: BlobStore, shard_id: str, save_key: str | None) -> ShardReceipt | None:
    """The receipt of shard ``shard_id`` if it is stored (row and blob), its tensors held for
    ``save_key``'s save; else None."""
    with db.transaction() as session:
        if save_key is not None:
            hold_shared(session)
            holds.renew(session, save_key, utcnow())
            holds.hold_shard(session, save_key, shard_id)
        size = session.scalar(select(Shard.size).where(Shard.id == shard_id))
        tensors = session.scalar(select(func.count()).select_from(Tensor).where(Tensor.shard_id == shard_id))
    if size is None or blobs.size(shard_id) is None:
        return None
    return ShardReceipt(shard_id=shard_id, size=int(size), tensors=int(tensors or 0), created=False)


def _remove_quietly(area: StagingArea, shard_id: str, token: str) -> None:
    try:
        area.remove(shard_id, token)
    except StorageError:
        pass  # what is left goes with garbage collection's sweep of staged uploads


def _unseal_quietly(area: StagingArea, shard_id: str, token: str, seal: str) -> None:
    try:
        area.unseal(shard_id, token, seal)
    except StorageError:
        pass  # what is left goes with garbage collection's sweep of staged uploads


def _check_shard_id(shard_id: str) -> None:
    try:
        check_blob_id(shard_id)
    except ValueError:
        raise InvalidInputError(f"{str(shard_id)[:80]!r} is not a shard id") from None


__all__ = [
    "StagedUploads",
    "abort_upload",
    "complete_upload",
    "start_upload",
    "verify_staged",
]
