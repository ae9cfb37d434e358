"""``ckptstore gc --orphans`` lists and aborts the S3 uploads a replica killed mid-upload left,
through a real server on PostgreSQL + S3 (moto)."""

from __future__ import annotations

import json
import uuid

import pytest

from ckptstore.service.blobs.s3 import S3BlobStore
from tests.backends import leave_upload_unfinished, unfinished_uploads
from tests.cli.conftest import Cli
from tests.client.models import TinyNet


@pytest.mark.parametrize("backend", ["http-postgres-s3"], indirect=True)
def test_gc_orphans_aborts_unfinished_uploads_past_the_grace_period(any_cli: Cli) -> None:
    assert any_cli.backend is not None
    blobs = any_cli.backend.blobs
    assert isinstance(blobs, S3BlobStore)
    s3, bucket = blobs.client, blobs.bucket
    any_cli.client.save("run", TinyNet(), step=1)
    digest = uuid.uuid4().hex * 2
    ours = leave_upload_unfinished(s3, bucket, f"{blobs.prefix}/{digest[:2]}/{digest}", [b"a" * 1000, b"b" * 500])
    theirs = leave_upload_unfinished(s3, bucket, f"elsewhere/{digest[:2]}/{digest}", [b"c" * 300])

    in_grace = json.loads(any_cli.ok("gc", "--orphans", "--json"))  # the default grace: one hour
    assert (in_grace["stale_uploads"], in_grace["uploads_aborted"]) == (0, 0)
    dry = json.loads(any_cli.ok("gc", "--orphans", "--grace", "0", "--dry-run", "--json"))
    assert (dry["stale_uploads"], dry["stale_upload_bytes"], dry["uploads_aborted"]) == (1, 1500, 0)
    assert "1 unfinished upload (1.5 KiB in parts)" in any_cli.ok("gc", "--orphans", "--grace", "0", "--dry-run")
    hint = any_cli.ok("gc", "--grace", "0")
    assert "1 unfinished upload " in hint and "`ckptstore gc --orphans` aborts them" in hint
    assert set(unfinished_uploads(s3, bucket)) == {ours, theirs}

    done = json.loads(any_cli.ok("gc", "--orphans", "--grace", "0", "--json"))

    assert (done["stale_uploads"], done["stale_upload_bytes"], done["uploads_aborted"]) == (1, 1500, 1)
    assert set(unfinished_uploads(s3, bucket)) == {theirs}
    assert json.loads(any_cli.ok("verify", "--json"))["ok"]
    again = json.loads(any_cli.ok("gc", "--orphans", "--grace", "0", "--json"))
    assert (again["stale_uploads"], again["uploads_aborted"], again["shards_swept"]) == (0, 0, 0)
