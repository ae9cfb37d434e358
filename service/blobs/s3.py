"""A BlobStore in an S3 bucket: ``s3://<bucket>/<prefix>/<ab>/<shard id>``, write-once.

Atomicity. S3 shows an object whole or not at all: a single PUT publishes the object when it
succeeds, and a multipart upload publishes it only at CompleteMultipartUpload. boto3's
transfer manager aborts a multipart upload that fails part-way, so a failed
:meth:`S3BlobStore.put_file` leaves no object under the key. A process killed mid-upload
leaves invisible parts that are billed until aborted: ``ckptstore gc --orphans`` aborts
those idle past its grace period (:mod:`service.blobs.s3_uploads`), and a bucket lifecycle rule
"AbortIncompleteMultipartUpload" of a few days (see the README) does it on S3's side. Two
writers racing to put the same id both write the same bytes (ids are content addresses the
engine verifies before it calls ``put_file``), so the last one to finish changes nothing.

Checksums. botocore 1.36 and later computes a CRC32 for every upload and, on HTTPS, sends
it as a trailing checksum in an ``aws-chunked`` body ("when_supported"). Several
S3-compatible stores (MinIO releases, Ceph RGW, other vendors' gateways) reject or mangle
such requests. The ``checksum`` setting (``CKPTSTORE_S3_CHECKSUM``) is passed to botocore as
both ``request_checksum_calculation`` and ``response_checksum_validation``; the default,
``when_required``, sends checksums only where an operation demands one. Set
``when_supported`` on AWS itself to have S3 check every upload as well. Ranged GETs, which
every read here is, carry no checksum S3 could validate either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ckptstore.service.blobs.base import READ_CHUNK_BYTES, BlobStore, StaleUploads, check_blob_id, flat_bytes
from ckptstore.service.blobs.s3_staging import S3Staging
from ckptstore.service.blobs.s3_uploads import abort_idle_uploads
from ckptstore.service.errors import IntegrityError, InvalidInputError, NotFoundError, StorageError
from ckptstore.service.format.digest import is_digest

CHECKSUM_MODES = ("when_required", "when_supported")
MIN_PART_BYTES = 5 << 20  # S3 refuses smaller parts (except the last one)
MAX_PART_BYTES = 5 << 30  # and larger ones
UPLOAD_CONCURRENCY = 4

# Errors from boto3, botocore and the HTTP stack under them; translated to StorageError here.
_BOTO_ERRORS = (BotoCoreError, ClientError, Boto3Error)
# A HEAD has no body, so S3 can only say "404"; a GET names the missing thing.
_MISSING_KEY_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def make_client(endpoint_url: str | None = None, checksum: str = "when_required", *, session: Any = None) -> Any:
    """A boto3 S3 client with ckptstore's retry, pool and checksum settings.

    Credentials, region and (when ``endpoint_url`` is None) ``AWS_ENDPOINT_URL`` come from the
    usual boto3 sources.

    Args:
        endpoint_url: An S3-compatible server's URL.
        checksum: ``when_required`` or ``when_supported`` (see the module docstring).
        session: A boto3 session to build the client from. By default a fresh one, which keeps
            client creation thread-safe but parses botocore's S3 model again (0.1-0.3 s); callers
            that build many clients in one thread (tests) pass a shared session.

    Raises:
        StorageError: boto3 could not build a client (e.g. an unknown ``AWS_PROFILE``).
    """
    config = Config(
        signature_version="s3v4",  # also for presigned URLs, which botocore would sign with SigV2 in us-east-1
        request_checksum_calculation=checksum,
        response_checksum_validation=checksum,
        retries={"max_attempts": 5, "mode": "standard"},
        max_pool_connections=16,
    )
    try:
        return (session or boto3.session.Session()).client("s3", endpoint_url=endpoint_url, config=config)
    except _BOTO_ERRORS as exc:
        raise StorageError(f"could not create an S3 client: {exc}") from exc


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3BlobStore(BlobStore):
    """Blobs as S3 objects under ``<prefix>/<first two hex characters>/<shard id>``.

    Every key is built from an id that passed :func:`check_blob_id`, so no request value
    ever reaches a key. Several stores can share a bucket under different prefixes.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        part_bytes: int = 64 << 20,
        checksum: str = "when_required",
        endpoint_url: str | None = None,
    ) -> None:
        """Open the store; no request is made until the first operation.

        Args:
            bucket: An existing bucket.
            prefix: Folder inside the bucket; leading and trailing slashes are ignored.
            client: A ready boto3 S3 client; when given, ``checksum`` and ``endpoint_url``
                are not used.
            part_bytes: Files of at least this size go up as multipart uploads of parts this
                large (5 MiB to 5 GiB).
            checksum: ``when_required`` or ``when_supported`` (see the module docstring).
            endpoint_url: An S3-compatible server's URL; default ``AWS_ENDPOINT_URL`` or AWS.

        Raises:
            InvalidInputError: a setting is out of range.
        """
        if not bucket:
            raise InvalidInputError("an S3 blob store needs a bucket: s3://bucket/prefix")
        if checksum not in CHECKSUM_MODES:
            raise InvalidInputError(
                f"S3 checksum mode (CKPTSTORE_S3_CHECKSUM) must be one of {', '.join(CHECKSUM_MODES)}, not {checksum!r}"
            )
        if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
            raise InvalidInputError(
                f"S3 part size (CKPTSTORE_S3_PART_BYTES) must be between {MIN_PART_BYTES} and {MAX_PART_BYTES} "
                f"bytes, not {part_bytes}"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_bytes = part_bytes
        self.checksum = checksum
        self.client = client if client is not None else make_client(endpoint_url, checksum)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self._transfer = TransferConfig(
            multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=UPLOAD_CONCURRENCY
        )
        self._bucket_seen = False

    def __repr__(self) -> str:
        return f"S3BlobStore('s3://{self.bucket}/{self.prefix}')"

    @property
    def location(self) -> str:
        """``s3://bucket/prefix``."""
        return f"s3://{self.bucket}/{self.prefix}"

    def abort_stale_uploads(self, idle_since: datetime, *, dry_run: bool = False) -> StaleUploads:
        """Abort (unless ``dry_run``) the incomplete multipart uploads of this store's blob keys
        with no part added since ``idle_since``; see :mod:`service.blobs.s3_uploads`.

        Raises:
            StorageError: the bucket is missing or S3 failed.
        """
        return abort_idle_uploads(self.client, self.bucket, self._base, idle_since, dry_run=dry_run)

    def _key(self, blob_id: str) -> str:
        check_blob_id(blob_id)
        return f"{self._base}{blob_id[:2]}/{blob_id}"

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD response, or None if the object is absent."""
        try:
            response: dict[str, Any] = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _error_code(exc) not in _MISSING_KEY_CODES:
                raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
            self._check_bucket()
            return None
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
        self._bucket_seen = True
        return response

    def _check_bucket(self) -> None:
        # A HEAD answers a bare 404 for a missing bucket too; without this check a misnamed
        # bucket would look like an empty store. Asked once per store, on the first miss.
        if self._bucket_seen:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _error_code(exc) in _MISSING_KEY_CODES | {"NoSuchBucket"}:
                raise StorageError(
                    f"bucket {self.bucket!r} does not exist; create it or fix the s3:// blob store URL"
                ) from exc
            raise StorageError(f"could not inspect bucket {self.bucket!r}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not inspect bucket {self.bucket!r}: {exc}") from exc
        self._bucket_seen = True

    def put_file(self, blob_id: str, path: Path) -> None:
        """Upload ``path`` under ``blob_id`` unless the blob already exists; the file is left in place.

        Files of ``part_bytes`` or more go up as a multipart upload with up to four parts in
        flight. Either way the object appears only once every byte has arrived.

        Raises:
            StorageError: the upload failed (the message names the key and the cause).
        """
        key = self._key(blob_id)
        if self._head(key) is not None:
            return
        try:
            self.client.upload_file(str(path), self.bucket, key, Config=self._transfer)
        except (*_BOTO_ERRORS, OSError) as exc:
            raise StorageError(f"could not upload blob {blob_id} to {self._where(key)}: {exc}") from exc

    def size(self, blob_id: str) -> int | None:
        """Size of the object from a HEAD request, or None if it is absent.

        Raises:
            StorageError: the bucket is missing or S3 failed.
        """
        head = self._head(self._key(blob_id))
        return None if head is None else int(head["ContentLength"])

    def _open_range(self, blob_id: str, key: str, offset: int, length: int) -> Any:
        """Start one ranged GET for ``length`` (> 0) bytes; the caller closes the returned body."""
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
            )
        except ClientError as exc:
            code = _error_code(exc)
            if code in _MISSING_KEY_CODES:
                raise NotFoundError(f"blob {blob_id} is missing from {self._where(key)}") from exc
            if code == "InvalidRange":  # the range starts at or after the object's end
                raise IntegrityError(
                    f"blob {blob_id} ends before byte {offset + 1}; {self._where(key)} was truncated"
                ) from exc
            raise StorageError(f"could not read {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not read {self._where(key)}: {exc}") from exc
        body = response["Body"]
        sent = int(response["ContentLength"])
        if sent != length:
            body.close()
            if sent < length:
                raise IntegrityError(
                    f"blob {blob_id} ends before byte {offset + length}; {self._where(key)} was truncated"
                )
            raise StorageError(f"{self._where(key)}: the server ignored the byte range and sent {sent} bytes")
        return body

    def _read_exactly(self, body: Any, count: int, blob_id: str, key: str) -> bytes:
        pieces: list[bytes] = []
        missing = count
        try:
            while missing:
                piece = body.read(missing)
                if not piece:  # botocore checks Content-Length, so this is a defence in depth
                    raise StorageError(f"the response for {self._where(key)} ended early; retry the read")
                pieces.append(piece)
                missing -= len(piece)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"reading blob {blob_id} from {self._where(key)} failed: {exc}") from exc
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from one ranged GET, streamed in pieces of at most 4 MiB.

        Raises:
            NotFoundError: the blob is absent.
            IntegrityError: the blob ends before the buffer is full.
            ValueError: ``offset`` is negative.
            StorageError: the bucket is missing or S3 failed.
        """
        self.read_scatter(blob_id, offset, [buffer])

    def read_scatter(self, blob_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn from one ranged GET, streamed in pieces of at most 4 MiB.

        The pieces are read with ``read`` and copied: urllib3's ``readinto`` reads a
        temporary bytes object of the buffer's size and copies it too.

        Raises:
            NotFoundError: the blob is absent.
            IntegrityError: the blob ends before the last buffer is full.
            ValueError: ``offset`` is negative.
            StorageError: the bucket is missing or S3 failed.
        """
        key = self._key(blob_id)
        if offset < 0:
            raise ValueError(f"offset {offset} is negative")
        length = sum(buffer.nbytes for buffer in buffers)
        if length == 0:  # an HTTP range cannot be empty; only presence is left to check
            if self._head(key) is None:
                raise NotFoundError(f"blob {blob_id} is missing from {self._where(key)}")
            return
        body = self._open_range(blob_id, key, offset, length)
        try:
            for buffer in buffers:
                self._fill(body, flat_bytes(buffer), blob_id, key)
        finally:
            body.close()

    def _fill(self, body: Any, buffer: memoryview, blob_id: str, key: str) -> None:
        done = 0
        while done < buffer.nbytes:
            piece = self._read_exactly(body, min(READ_CHUNK_BYTES, buffer.nbytes - done), blob_id, key)
            buffer[done : done + len(piece)] = piece
            done += len(piece)

    def iter_range(
        self, blob_id: str, offset: int, length: int, chunk_bytes: int = READ_CHUNK_BYTES
    ) -> Iterator[bytes]:
        """Yield ``length`` bytes from ``offset`` in pieces of ``chunk_bytes``, from a single ranged GET.

        The request is made when the first piece is asked for; closing the iterator early
        closes the response. No reference to a piece is kept once it is yielded.

        Raises:
            NotFoundError: the blob is absent.
            IntegrityError: the blob ends before ``offset + length``.
            ValueError: ``offset`` is negative or ``chunk_bytes`` is not positive.
            StorageError: the bucket is missing or S3 failed.
        """
        key = self._key(blob_id)
        if offset < 0:
            raise ValueError(f"offset {offset} is negative")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes {chunk_bytes} is not positive")
        if length <= 0:
            return
        body = self._open_range(blob_id, key, offset, length)
        try:
            remaining = length
            while remaining:
                size = min(chunk_bytes, remaining)
                remaining -= size
                yield self._read_exactly(body, size, blob_id, key)
        finally:
            body.close()

    def read_urls(self, blob_ids: Sequence[str], expires_seconds: int) -> dict[str, str]:
        """A presigned GET URL of each blob's object, valid for ``expires_seconds``.

        Signed locally with the store's credentials (no request is made); the URLs carry the
        signature, so they are handed only to a caller allowed to read and never logged.
        """
        urls: dict[str, str] = {}
        for blob_id in blob_ids:
            key = self._key(blob_id)
            try:
                urls[blob_id] = self.client.generate_presigned_url(
                    "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_seconds
                )
            except _BOTO_ERRORS as exc:
                raise StorageError(f"could not sign a read of {self._where(key)}: {exc}") from exc
        return urls

    def staging(self) -> S3Staging:
        """Uploads clients send straight to ``<prefix>/staging/`` with presigned URLs, copied to
        blob keys once the server has verified them (:mod:`service.blobs.s3_staging`)."""
        return S3Staging(self.client, self.bucket, self._base, self.part_bytes, self._key)

    def delete(self, blob_id: str) -> None:
        """Delete the object; deleting an absent blob is not an error.

        Raises:
            StorageError: the bucket is missing or S3 failed.
        """
        key = self._key(blob_id)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not delete {self._where(key)}: {exc}") from exc

    def list_ids(self) -> Iterator[str]:
        """Every blob id under the prefix, in key order, page by page.

        Keys that are not ``<ab>/<id>`` with ``ab`` the id's first two characters (other
        prefixes' blobs, stray objects) are skipped.

        Raises:
            StorageError: the bucket is missing or S3 failed.
        """
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._base):
                for item in page.get("Contents", ()):
                    folder, _, name = item["Key"][len(self._base) :].partition("/")
                    if is_digest(name) and folder == name[:2]:
                        yield name
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not list s3://{self.bucket}/{self._base}: {exc}") from exc
