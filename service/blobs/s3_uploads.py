"""Incomplete S3 multipart uploads: finding the ones a killed writer left, and aborting them.

A multipart upload (every blob of ``part_bytes`` or more) publishes nothing until it is
completed, but its parts are stored, and billed, until it is completed or aborted. boto3
aborts an upload that fails in the process; a process killed part-way cannot, so its upload
stays. Garbage collection (:func:`service.reclaim.gc.collect`) reports them, and with ``orphans``
aborts those idle for longer than its grace period. A bucket lifecycle rule
``AbortIncompleteMultipartUpload`` (see the README) does the same on S3's side.

*Idle* is measured from an upload's newest part (its start, if it has none): a slow upload of
a large shard that started long ago but is still sending parts is not taken for abandoned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError

from ckptstore.service.blobs.base import StaleUploads
from ckptstore.service.errors import StorageError
from ckptstore.service.format.digest import is_digest

_BOTO_ERRORS = (BotoCoreError, ClientError, Boto3Error)


@dataclass(frozen=True)
class Upload:
    """One incomplete multipart upload of a blob key."""

    key: str
    upload_id: str
    last_active: datetime
    bytes: int


def _is_blob_key(key: str, base: str) -> bool:
    """Whether ``key`` is ``<base><ab>/<shard id>``: a blob of this store, not another prefix's."""
    if not key.startswith(base):
        return False
    folder, _, name = key[len(base) :].partition("/")
    return is_digest(name) and folder == name[:2]


def _parts(client: Any, bucket: str, key: str, upload_id: str) -> tuple[int, datetime | None] | None:
    """Total bytes and newest LastModified of an upload's parts; None if it ended meanwhile."""
    total, newest = 0, None
    try:
        for page in client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id):
            for part in page.get("Parts", ()):
                total += int(part.get("Size", 0))
                modified = part.get("LastModified")
                if modified is not None and (newest is None or modified > newest):
                    newest = modified
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) == "NoSuchUpload":
            return None  # completed or aborted since it was listed
        raise
    return total, newest


def incomplete_uploads(
    client: Any, bucket: str, base: str, keys: Callable[[str, str], bool] = _is_blob_key
) -> Iterator[Upload]:
    """Every incomplete multipart upload of a blob key under ``base`` (``prefix/`` or ``""``);
    with ``keys``, of every key under ``base`` it accepts (called as ``keys(key, base)``).

    Raises:
        StorageError: the bucket is missing or S3 failed.
    """
    try:
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=base)
        for page in pages:
            for item in page.get("Uploads", ()):
                key, upload_id = item["Key"], item["UploadId"]
                if not keys(key, base):
                    continue
                parts = _parts(client, bucket, key, upload_id)
                if parts is None:
                    continue
                total, newest = parts
                started = item["Initiated"]
                yield Upload(key, upload_id, max(started, newest) if newest is not None else started, total)
    except _BOTO_ERRORS as exc:
        raise StorageError(f"could not list the incomplete uploads in s3://{bucket}/{base}: {exc}") from exc


def abort_idle_uploads(
    client: Any,
    bucket: str,
    base: str,
    idle_since: datetime,
    *,
    dry_run: bool,
    keys: Callable[[str, str], bool] = _is_blob_key,
) -> StaleUploads:
    """Abort (unless ``dry_run``) the incomplete uploads under ``base`` (of the keys ``keys``
    accepts, by default blob keys) with no activity since ``idle_since``.

    Raises:
        StorageError: S3 failed (uploads aborted before the failure stay aborted).
    """
    found = total = aborted = 0
    for upload in incomplete_uploads(client, bucket, base, keys):
        if upload.last_active >= idle_since:
            continue
        found += 1
        total += upload.bytes
        if dry_run:
            continue
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=upload.key, UploadId=upload.upload_id)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) == "NoSuchUpload":
                continue  # finished or aborted by someone else meanwhile
            raise StorageError(f"could not abort the upload of s3://{bucket}/{upload.key}: {exc}") from exc
        except _BOTO_ERRORS as exc:
            raise StorageError(f"could not abort the upload of s3://{bucket}/{upload.key}: {exc}") from exc
        aborted += 1
    return StaleUploads(found=found, bytes=total, aborted=aborted)
