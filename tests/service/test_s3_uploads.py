"""Incomplete S3 multipart uploads (a writer killed mid-upload) are found, reported and aborted by
garbage collection, on a real moto S3 server with the metadata on PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptstore.service.blobs import LocalBlobStore, MemoryBlobStore, StaleUploads
from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.db import Database
from ckptstore.service.errors import StorageError
from ckptstore.service.reclaim.gc import collect
from ckptstore.service.store import Store
from tests.backends import empty_tables, leave_upload_unfinished, unfinished_uploads

PREFIX = "ckpt"


def blob_key(prefix: str = PREFIX) -> str:
    digest = uuid.uuid4().hex * 2
    return f"{prefix}/{digest[:2]}/{digest}" if prefix else f"{digest[:2]}/{digest}"


def newest_part(s3: Any, bucket: str, key: str, upload_id: str) -> datetime:
    parts = s3.list_parts(Bucket=bucket, Key=key, UploadId=upload_id)["Parts"]
    return max(part["LastModified"] for part in parts)


@pytest.fixture
def s3(s3_endpoint: str) -> Any:
    return make_client(s3_endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:20]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def store(pg_url: str, s3: Any, bucket: str, tmp_path: Path) -> Iterator[Store]:
    """An empty store on PostgreSQL with its blobs under ``s3://bucket/ckpt``."""
    database = Database(pg_url)
    empty_tables(database)
    opened = Store(database, S3BlobStore(bucket, PREFIX, client=s3), tmp_path / "staging")
    try:
        yield opened
    finally:
        opened.close()


def test_gc_reports_and_with_orphans_aborts_only_this_stores_idle_uploads(store: Store, s3: Any, bucket: str) -> None:
    old_key = blob_key()
    old = leave_upload_unfinished(s3, bucket, old_key, [b"a" * 1000, b"b" * 500])
    old_active = newest_part(s3, bucket, old_key, old)
    # Untouched whatever their age: another prefix's blob, the bucket's root, a stray key in ours.
    elsewhere = {
        leave_upload_unfinished(s3, bucket, blob_key("other"), [b"c" * 300]),
        leave_upload_unfinished(s3, bucket, blob_key(""), [b"c" * 300]),
        leave_upload_unfinished(s3, bucket, f"{PREFIX}-2/{blob_key('')}", [b"c" * 300]),
        leave_upload_unfinished(s3, bucket, f"{PREFIX}/notes/readme.txt", [b"c" * 300]),
    }
    young_key = blob_key()
    young = leave_upload_unfinished(s3, bucket, young_key, [b"d" * 700])
    deadline = datetime.now(old_active.tzinfo) + timedelta(seconds=10)
    # S3 dates parts to the second: send the young upload's part again until it is a later second.
    while (young_active := newest_part(s3, bucket, young_key, young)) <= old_active:
        assert datetime.now(old_active.tzinfo) < deadline, "S3's clock did not move on"
        s3.upload_part(Bucket=bucket, Key=young_key, UploadId=young, PartNumber=1, Body=b"d" * 700)
    grace = 3600
    now = young_active + timedelta(seconds=grace)  # the grace period reaches back to the young upload exactly

    dry = collect(store.db, store.blobs, grace_seconds=grace, dry_run=True, orphans=True, now=now)
    reported = collect(store.db, store.blobs, grace_seconds=grace, now=now)  # without orphans: only reported

    for report in (dry, reported):
        assert (report.stale_uploads, report.stale_upload_bytes, report.uploads_aborted) == (1, 1500, 0)
    assert set(unfinished_uploads(s3, bucket)) == {old, young} | elsewhere

    done = collect(store.db, store.blobs, grace_seconds=grace, orphans=True, now=now)

    assert (done.stale_uploads, done.stale_upload_bytes, done.uploads_aborted) == (1, 1500, 1)
    assert set(unfinished_uploads(s3, bucket)) == {young} | elsewhere
    again = collect(store.db, store.blobs, grace_seconds=grace, orphans=True, now=now)
    assert (again.stale_uploads, again.uploads_aborted) == (0, 0)
    # Once the young one has been idle past the grace period too, it goes.
    later = collect(store.db, store.blobs, grace_seconds=grace, orphans=True, now=now + timedelta(seconds=1))
    assert (later.stale_uploads, later.stale_upload_bytes, later.uploads_aborted) == (1, 700, 1)
    assert set(unfinished_uploads(s3, bucket)) == elsewhere


def test_an_upload_still_receiving_parts_is_not_idle(s3: Any, bucket: str) -> None:
    # Idle is measured from the newest part, not from the upload's start.
    blobs = S3BlobStore(bucket, PREFIX, client=s3)
    key = blob_key()
    upload = leave_upload_unfinished(s3, bucket, key, [b"e" * 100])
    active = newest_part(s3, bucket, key, upload)
    started = s3.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["Initiated"]
    assert blobs.abort_stale_uploads(max(started, active)) == StaleUploads()
    assert blobs.abort_stale_uploads(active + timedelta(seconds=1), dry_run=True) == StaleUploads(1, 100, 0)
    assert set(unfinished_uploads(s3, bucket)) == {upload}


def a_day_from_now() -> datetime:
    return datetime.now().astimezone() + timedelta(days=1)


def test_a_missing_bucket_is_a_storage_error_naming_it(s3: Any) -> None:
    blobs = S3BlobStore(f"absent-{uuid.uuid4().hex[:12]}", PREFIX, client=s3)
    with pytest.raises(StorageError, match=f"s3://{blobs.bucket}/{PREFIX}/"):
        blobs.abort_stale_uploads(a_day_from_now())


def test_local_and_memory_blob_stores_have_no_unfinished_uploads(tmp_path: Path) -> None:
    assert LocalBlobStore(tmp_path / "blobs").abort_stale_uploads(a_day_from_now()) == StaleUploads()
    assert MemoryBlobStore().abort_stale_uploads(a_day_from_now()) == StaleUploads()


def test_the_documented_lifecycle_rule_is_one_s3_accepts(s3: Any, bucket: str) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    command = page[page.index("aws s3api put-bucket-lifecycle-configuration") :]
    rules = json.loads(command[command.index("'") + 1 : command.index("}'") + 1])
    (rule,) = rules["Rules"]
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration=rules)
    (stored,) = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert stored["AbortIncompleteMultipartUpload"] == rule["AbortIncompleteMultipartUpload"]
    assert stored["Filter"] == rule["Filter"] and stored["Status"] == "Enabled"
