"""Shards clients upload to S3 themselves: presigned PUTs to staging keys, sealed, verified, then copied to blob keys.

Layout. A staged upload lives at ``<prefix>/staging/<shard id>.<token>``, the token 128 random
bits the server drew (:meth:`S3Staging.plan`), never at the blob's key
``<prefix>/<ab>/<shard id>``: what a client sends is not a blob, and no listing of blobs
(:meth:`S3BlobStore.list_ids`, orphans, unfinished blob uploads) sees it.

Sealing. The staged key stays writable by whoever holds its URL until the URL expires: a
client could ``PUT`` other bytes of the same length while the server checks the first ones, and
an ETag does not tell them apart (an MD5, which collisions defeat). So the server first copies
the staged object, inside S3, to a sealed key ``<prefix>/staging/<shard id>.<token>.<seal>``
whose ``seal`` is 128 more random bits drawn for this one completion and for which no URL was
ever signed (:meth:`S3Staging.seal`). Only the server writes it, once: the bytes it then reads
and checks (header, every tensor's digest) are exactly the bytes it copies to the blob key
(``CopyObject``; a multipart copy above 5 GiB), whatever the client does to the staged key
meanwhile. A second completion of the same upload draws its own seal, so it never replaces
bytes another completion is checking.

A shard up to ``part_bytes`` goes up as one presigned ``PUT``; a larger one as a multipart upload
the server starts, with a presigned ``UploadPart`` URL per part. The server completes it itself,
from the parts S3 lists, after checking each one is there and of its planned size, so the client
sends no ETags and no part list.

Leftovers. A client killed before it finished leaves a staged object or an unfinished multipart
upload; :meth:`S3Staging.sweep` (``ckptstore gc --orphans``, after the grace period) deletes and
aborts those idle since the cut-off, and a bucket lifecycle rule expiring ``<prefix>/staging/``
does it on S3's side.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from ckptstore.service.blobs.base import (
    READ_CHUNK_BYTES,
    STAGING_TOKEN_PATTERN,
    StagingArea,
    StaleUploads,
    UploadPlan,
    check_blob_id,
    check_staging_token,
)
from ckptstore.service.blobs.s3_uploads import abort_idle_uploads
from ckptstore.service.errors import InvalidInputError, NotFoundError, PayloadTooLargeError, StorageError
from ckptstore.service.format.digest import is_digest

#: The folder under the store's prefix that staged uploads live in.
STAGING_FOLDER = "staging/"
#: S3's limits: parts of a multipart upload, and the largest part (and single PUT or CopyObject).
MAX_PARTS = 10_000
MAX_PART_BYTES = 5 << 30
#: Parts of a multipart copy (only shards above 5 GiB are copied in parts).
COPY_PART_BYTES = 1 << 30

_BOTO_ERRORS = (BotoCoreError, ClientError, Boto3Error)
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_TOKEN = re.compile(STAGING_TOKEN_PATTERN)
#: What S3 answers a CompleteMultipartUpload whose parts it will not join: the client's fault.
_BAD_PARTS = frozenset({"InvalidPart", "InvalidPartOrder", "EntityTooSmall", "EntityTooLarge"})


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def is_staging_key(key: str, base: str) -> bool:
    """Whether ``key`` is ``<base><shard id>.<token>`` (a staged upload) or ``<base><shard id>.<token>.<seal>``
    (its sealed copy), not a stray object."""
    if not key.startswith(base):
        return False
    shard_id, *tokens = key[len(base) :].split(".")
    return is_digest(shard_id) and len(tokens) in (1, 2) and all(_TOKEN.match(token) for token in tokens)


def part_size(size: int, part_bytes: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``part_bytes``, or larger where
    that would take more than :data:`MAX_PARTS` parts."""
    return max(part_bytes, -(-size // MAX_PARTS))


class S3Staging(StagingArea):
    """Staged uploads under ``<base>staging/`` of one bucket (see the module's description).

    Args:
        client: the store's boto3 S3 client (every request the server makes goes through it).
        bucket: the store's bucket.
        base: the store's prefix with its trailing slash, or ``""``.
        part_bytes: shards larger than this go up in parts this large.
        blob_key: the blob key of a shard id (the store's).
        signer: the client that signs URLs (default ``client``); signing makes no request.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        base: str,
        part_bytes: int,
        blob_key: Callable[[str], str],
        *,
        signer: Any = None,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.base = f"{base}{STAGING_FOLDER}"
        self.part_bytes = part_bytes
        self.signer = client if signer is None else signer
        self._blob_key = blob_key

    def _key(self, shard_id: str, token: str) -> str:
        return f"{self.base}{check_blob_id(shard_id)}.{check_staging_token(token)}"

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _sign(self, operation: str, params: dict[str, Any], expires_seconds: int) -> str:
        try:
            url: str = self.signer.generate_presigned_url(operation, Params=params, ExpiresIn=expires_seconds)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not sign an upload to {self._where(params['Key'])}: {exc}") from exc
        return url

    def plan(self, shard_id: str, size: int, expires_seconds: int) -> UploadPlan:
        """A fresh staging key for shard ``shard_id`` and its presigned ``PUT`` URL(s).

        Raises:
            PayloadTooLargeError: ``size`` needs parts above S3's largest.
            StorageError: S3 did not start the multipart upload.
        """
        token = secrets.token_hex(16)
        key = self._key(shard_id, token)
        # Each URL signs its body's length (Content-Length is a signed header): S3 refuses any
        # other, so a write token cannot stage more bytes than it asked to.
        if size <= self.part_bytes:
            url = self._sign("put_object", {"Bucket": self.bucket, "Key": key, "ContentLength": size}, expires_seconds)
            return UploadPlan(token=token, size=size, part_bytes=size, urls=(url,), expires_in=expires_seconds)
        part = part_size(size, self.part_bytes)
        if part > MAX_PART_BYTES:
            raise PayloadTooLargeError(f"a shard of {size} bytes is more than S3 takes in {MAX_PARTS} parts")
        try:
            upload_id = str(self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"])
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not start an upload to {self._where(key)}: {exc}") from exc
        urls = tuple(
            self._sign(
                "upload_part",
                {
                    "Bucket": self.bucket,
                    "Key": key,
                    "UploadId": upload_id,
                    "PartNumber": number,
                    "ContentLength": min(part, size - (number - 1) * part),
                },
                expires_seconds,
            )
            for number in range(1, -(-size // part) + 1)
        )
        return UploadPlan(token=token, size=size, part_bytes=part, urls=urls, expires_in=expires_seconds)

    def _open_uploads(self, key: str) -> list[str]:
        """The ids of the unfinished multipart uploads of exactly ``key``."""
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=key)
            return [item["UploadId"] for page in pages for item in page.get("Uploads", ()) if item["Key"] == key]
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not list the uploads of {self._where(key)}: {exc}") from exc

    def finish(self, shard_id: str, token: str, size: int) -> int:
        """Complete the multipart upload of the staged key, if one is open, then return the staged
        object's size.

        Raises:
            NotFoundError: nothing is staged under ``token``.
            InvalidInputError: a part is missing, extra or of the wrong size (nothing is completed).
            StorageError: S3 failed.
        """
        key = self._key(shard_id, token)
        for upload_id in self._open_uploads(key):
            self._complete(shard_id, key, upload_id, size)
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise NotFoundError(
                    f"no bytes of shard {shard_id} were uploaded under upload {token} (never sent, cut off, or "
                    "removed after its grace period); ask for a new upload"
                ) from exc
            raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
        return int(head["ContentLength"])

    def _complete(self, shard_id: str, key: str, upload_id: str, size: int) -> None:
        """Join the parts of ``upload_id`` once each planned part of a ``size``-byte shard is there."""
        parts: dict[int, tuple[int, str]] = {}
        try:
            pages = self.client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=key, UploadId=upload_id)
            for page in pages:
                for item in page.get("Parts", ()):
                    parts[int(item["PartNumber"])] = (int(item["Size"]), str(item["ETag"]))
        except ClientError as exc:
            if _code(exc) == "NoSuchUpload":
                return  # completed (or aborted) meanwhile: the object, or its absence, tells which
            raise StorageError(f"could not list the parts of {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not list the parts of {self._where(key)}: {exc}") from exc
        part = part_size(size, self.part_bytes)
        count = -(-size // part)
        if size <= self.part_bytes or count > MAX_PARTS:
            raise InvalidInputError(f"the upload of shard {shard_id} was planned for another size than {size} bytes")
        missing = [n for n in range(1, count + 1) if n not in parts]
        extra = sorted(set(parts) - set(range(1, count + 1)))
        wrong = [n for n in range(1, count + 1) if n in parts and parts[n][0] != min(part, size - (n - 1) * part)]
        if missing or extra or wrong:
            problems = [f"{label} {', '.join(map(str, numbers[:10]))}" for label, numbers in
                        (("missing parts", missing), ("unplanned parts", extra), ("parts of the wrong size", wrong))
                        if numbers]  # fmt: skip
            raise InvalidInputError(
                f"the upload of shard {shard_id} ({count} parts of {part} bytes) has {'; '.join(problems)}; "
                "nothing was stored: upload the shard again"
            )
        listed = [{"PartNumber": n, "ETag": parts[n][1]} for n in range(1, count + 1)]
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": listed}
            )
        except ClientError as exc:
            if _code(exc) == "NoSuchUpload":
                return
            if _code(exc) in _BAD_PARTS:
                raise InvalidInputError(f"S3 refused to join the parts of shard {shard_id}: {_code(exc)}") from exc
            raise StorageError(f"could not complete the upload of {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not complete the upload of {self._where(key)}: {exc}") from exc

    def _sealed_key(self, shard_id: str, token: str, seal: str) -> str:
        return f"{self._key(shard_id, token)}.{check_staging_token(seal)}"

    def _copy(self, source_key: str, target: str, size: int) -> None:
        """Copy ``source_key`` to ``target`` inside the bucket: one ``CopyObject`` up to 5 GiB, in parts above."""
        source = {"Bucket": self.bucket, "Key": source_key}
        if size <= MAX_PART_BYTES:
            self.client.copy_object(Bucket=self.bucket, Key=target, CopySource=source)
        else:
            config = TransferConfig(multipart_threshold=MAX_PART_BYTES, multipart_chunksize=COPY_PART_BYTES)
            self.client.copy(source, self.bucket, target, Config=config)

    def seal(self, shard_id: str, token: str, size: int) -> str:
        """Copy the staged object to a sealed key only the server writes (see the module's description);
        returns the seal naming it.

        Raises:
            NotFoundError: nothing is staged under ``token``.
            StorageError: S3 failed.
        """
        seal = secrets.token_hex(16)
        key, sealed = self._key(shard_id, token), self._sealed_key(shard_id, token, seal)
        try:
            self._copy(key, sealed, size)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise NotFoundError(f"the staged upload {token} of shard {shard_id} is gone; upload it again") from exc
            raise StorageError(f"could not seal {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not seal {self._where(key)}: {exc}") from exc
        return seal

    def read(self, shard_id: str, token: str, seal: str, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
        """The sealed object's bytes in order, from one GET, in pieces of at most ``chunk_bytes``.

        Raises:
            NotFoundError: nothing is sealed under ``token`` and ``seal``.
            StorageError: S3 failed.
        """
        key = self._sealed_key(shard_id, token, seal)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise NotFoundError(f"the staged upload {token} of shard {shard_id} is gone; upload it again") from exc
            raise StorageError(f"could not read {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not read {self._where(key)}: {exc}") from exc
        try:
            while True:
                try:
                    piece = body.read(chunk_bytes)
                except _BOTO_ERRORS as exc:
                    raise StorageError(f"reading {self._where(key)} failed: {exc}") from exc
                if not piece:
                    return
                yield piece
        finally:
            body.close()

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return False
            raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not inspect {self._where(key)}: {exc}") from exc
        return True

    def publish(self, shard_id: str, token: str, seal: str, size: int) -> None:
        """Copy the sealed (verified) object to the blob key inside S3 (no byte passes through the
        server), unless the blob exists: one ``CopyObject`` up to 5 GiB, a multipart copy above.

        Raises:
            StorageError: S3 failed (the blob key then holds nothing new).
        """
        target = self._blob_key(shard_id)
        if self._exists(target):
            return
        try:
            self._copy(self._sealed_key(shard_id, token, seal), target, size)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not copy shard {shard_id} to {self._where(target)}: {exc}") from exc

    def unseal(self, shard_id: str, token: str, seal: str) -> None:
        """Delete the sealed copy ``seal`` of the staged upload, if it exists.

        Raises:
            StorageError: S3 failed (garbage collection removes it after its grace period).
        """
        key = self._sealed_key(shard_id, token, seal)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not delete {self._where(key)}: {exc}") from exc

    def remove(self, shard_id: str, token: str) -> None:
        """Abort the staged key's unfinished multipart upload and delete its object, if either exists.

        Raises:
            StorageError: S3 failed (garbage collection removes what is left after its grace period).
        """
        key = self._key(shard_id, token)
        for upload_id in self._open_uploads(key):
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":
                    raise StorageError(f"could not abort the upload of {self._where(key)}: {exc}") from exc
            except _BOTO_ERRORS as exc:
                raise StorageError(f"could not abort the upload of {self._where(key)}: {exc}") from exc
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not delete {self._where(key)}: {exc}") from exc

    def sweep(self, idle_since: datetime, *, dry_run: bool = False) -> StaleUploads:
        """Delete (unless ``dry_run``) staged objects and sealed copies last written before ``idle_since``, and abort
        unfinished staged uploads with no part added since then.

        Raises:
            StorageError: S3 failed (what was removed before the failure stays removed).
        """
        found = total = removed = 0
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.base):
                for item in page.get("Contents", ()):
                    key = item["Key"]
                    if not is_staging_key(key, self.base) or item["LastModified"] >= idle_since:
                        continue
                    found += 1
                    total += int(item.get("Size", 0))
                    if not dry_run:
                        self.client.delete_object(Bucket=self.bucket, Key=key)
                        removed += 1
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not sweep the staged uploads in {self._where(self.base)}: {exc}") from exc
        uploads = abort_idle_uploads(
            self.client, self.bucket, self.base, idle_since, dry_run=dry_run, keys=is_staging_key
        )
        return StaleUploads(found=found + uploads.found, bytes=total + uploads.bytes, aborted=removed + uploads.aborted)
