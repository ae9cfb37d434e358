"""Storage faults end in a clean error and leave the store as it was; the retry then succeeds.

Each fault (see tests/faults/faulty.py) is injected where it happens for real: the disk filling
up while a blob is copied in, fsync failing, part 2 of an S3 multipart upload refused or its
connection lost, a read cut off by a reset connection, the server's staging disk filling up.
Each is driven through the engine (``Store.ingest_file``, ``Store.read_into``) and through a
real uvicorn server over the same store, and must end in StorageError, over HTTP a 503 with a
JSON body saying ``storage`` (never a 500, never a 2xx). Afterwards the store still lacks what
it lacked (``missing`` lists the digests), holds no new blob, and has nothing left in staging,
in ``.incoming`` or among the bucket's multipart uploads.
"""

from __future__ import annotations

import errno
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.db import Database
from ckptstore.service.errors import StorageError
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import ADMIN_TOKEN, TOKENS, Shard, bearer, build_shard, is_json_error, tensor
from tests.faults.faulty import FaultyBlobStore, fail_staging_writes, os_error
from tests.servers import running_server

PART_BYTES = 5 << 20  # the smallest part S3 accepts
SMALL = build_shard(tensor(1, "F32", (64, 64)), tensor(2, "I64", (32,)), tensor(3, "BF16", (7, 5)))
# Three parts of a multipart upload (the last one short), so part 2 fails with part 1 sent.
BIG = build_shard(tensor(4, "U8", (2 * PART_BYTES + (1 << 20),)), tensor(5, "F32", (8,)))


@dataclass
class Rig:
    """A store whose blobs go through a FaultyBlobStore, and a server over it when asked."""

    store: Store
    blobs: FaultyBlobStore
    s3: Any = None
    bucket: str = ""
    url: str = ""

    def ingest(self, shard: Shard) -> ShardReceipt:
        path = self.store.staging_path()
        path.write_bytes(shard.data)
        return self.store.ingest_file(path)

    def read(self, shard: Shard, offset: int = 0) -> bytes:
        buffer = bytearray(len(shard.data) - offset)
        self.store.read_into(shard.shard_id, offset, memoryview(buffer))
        return bytes(buffer)

    def stored(self) -> list[str]:
        """The blob ids really in the backend."""
        return sorted(self.blobs.inner.list_ids())

    def leftovers(self) -> list[str]:
        """Temporary files and unfinished uploads: staging, ``.incoming``, S3 multipart uploads."""
        found = [str(p) for p in self.store.staging_dir.rglob("*") if p.is_file()]
        inner = self.blobs.inner
        if isinstance(inner, LocalBlobStore):
            found += [str(p) for p in (inner.root / ".incoming").rglob("*") if p.is_file()]
        else:
            uploads = self.s3.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
            found += [f"multipart upload of {u['Key']}" for u in uploads]
        return found

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=bearer("admin"), timeout=60)


@pytest.fixture(scope="module")
def boto_session(s3_endpoint: str) -> Any:
    """One session for the module's clients (each fresh session parses botocore's S3 model again)."""
    import boto3

    return boto3.session.Session()


@pytest.fixture
def make_rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Rig]]:
    """Builds rigs on a local folder or a fresh bucket of the moto server, optionally served."""
    with ExitStack() as stack:

        def make(backend: str, *, serve: bool = False) -> Rig:
            home = tmp_path / f"home-{uuid.uuid4().hex[:8]}"
            s3: Any = None
            bucket = ""
            if backend == "local":
                inner: Any = LocalBlobStore(home / "blobs")
            else:
                endpoint = request.getfixturevalue("s3_endpoint")
                session = request.getfixturevalue("boto_session")
                s3 = make_client(endpoint, session=session)
                bucket = f"faults-{uuid.uuid4().hex[:20]}"
                s3.create_bucket(Bucket=bucket)
                stack.callback(_drop_bucket, s3, bucket)
                # A client of its own: the fault hooks must not reach the inspecting client.
                inner = S3BlobStore(
                    bucket, "ckpt", client=make_client(endpoint, session=session), part_bytes=PART_BYTES
                )
            blobs = FaultyBlobStore(inner)
            store = Store(Database.sqlite_file(home / "metadata.db"), blobs, home / "staging")
            stack.callback(store.close)
            rig = Rig(store, blobs, s3, bucket)
            if serve:
                app = create_app(store, Settings(home=home, tokens=TOKENS))
                rig.url = stack.enter_context(running_server(app))
            return rig

        yield make


def _drop_bucket(s3: Any, bucket: str) -> None:
    for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
        s3.delete_object(Bucket=bucket, Key=item["Key"])
    s3.delete_bucket(Bucket=bucket)


def assert_storage_response(response: httpx.Response, *, full: bool = False) -> None:
    """A 503 'storage' (a passing failure) or, for a full disk, a 507 'storage_full', with the JSON
    error body: no 500, no traceback, no success."""
    status, code = (507, "storage_full") if full else (503, "storage")
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert is_json_error(response), response.text[:300]
    assert response.json()["code"] == code
    assert "Traceback" not in response.text


def is_full_disk(case: Case) -> bool:
    """Whether the case's fault is a full disk (ENOSPC), which the store reports as such."""
    error = case.error()
    return isinstance(error, OSError) and error.errno == errno.ENOSPC


@dataclass(frozen=True)
class Case:
    backend: str
    point: str
    error: Callable[[], BaseException]
    shard: Shard


def _s3_refusal() -> ClientError:
    return ClientError({"Error": {"Code": "InternalError", "Message": "injected: part refused"}}, "UploadPart")


def _s3_unreachable() -> EndpointConnectionError:
    return EndpointConnectionError(endpoint_url="http://s3.invalid/injected")


PUT_CASES = {
    "local-enospc-during-copy": Case("local", "copy-write", lambda: os_error(errno.ENOSPC), SMALL),
    "local-eio-on-fsync-of-the-blob": Case("local", "fsync-file", lambda: os_error(errno.EIO), SMALL),
    "local-eio-on-fsync-of-its-folder": Case("local", "fsync-dir", lambda: os_error(errno.EIO), SMALL),
    "s3-part-2-refused": Case("s3", "upload-part", _s3_refusal, BIG),
    "s3-part-2-connection-lost": Case("s3", "upload-part", _s3_unreachable, BIG),
}
READ_CASES = {
    "local-eio": Case("local", "pread", lambda: os_error(errno.EIO), SMALL),
    "local-connection-reset": Case("local", "pread", lambda: os_error(errno.ECONNRESET), SMALL),
    "s3-connection-reset-mid-body": Case("s3", "get-body", lambda: os_error(errno.ECONNRESET), SMALL),
}


def assert_unchanged_after_failed_put(rig: Rig, case: Case) -> None:
    """Nothing stored, nothing left behind; the store still asks for every tensor of the shard."""
    assert rig.blobs.fired == 1, "the fault never fired: the test proved nothing"
    assert rig.leftovers() == []
    for path, size in rig.blobs.partial_files:  # the copy was cut with bytes on disk; they are gone
        assert size > 0 and not path.exists()
    assert rig.store.missing(case.shard.digests) == case.shard.digests
    if case.point == "fsync-dir":
        # The blob was already in place when its folder's fsync failed. It stays, whole and
        # unrecorded (deleting it could race another put of the same shard that has just been
        # recorded); the retry fsyncs the folder and records it.
        assert rig.stored() == [case.shard.shard_id]
        assert isinstance(rig.blobs.inner, LocalBlobStore)
        assert (rig.blobs.inner.root / case.shard.shard_id[:2] / case.shard.shard_id).read_bytes() == case.shard.data
    else:
        assert rig.stored() == []


def assert_retry_stores(rig: Rig, case: Case, receipt: ShardReceipt | dict[str, Any]) -> None:
    created = receipt.created if isinstance(receipt, ShardReceipt) else receipt["created"]
    assert created is True
    assert rig.stored() == [case.shard.shard_id]
    assert rig.store.missing(case.shard.digests) == []
    assert rig.read(case.shard) == case.shard.data
    assert rig.leftovers() == []


@pytest.mark.parametrize("case", list(PUT_CASES.values()), ids=list(PUT_CASES))
def test_a_failed_put_through_the_engine_is_a_storage_error_and_changes_nothing(
    make_rig: Callable[..., Rig], case: Case
) -> None:
    rig = make_rig(case.backend)
    rig.blobs.arm(case.point, case.error())
    with pytest.raises(StorageError) as caught:
        rig.ingest(case.shard)
    assert case.shard.shard_id in str(caught.value)
    assert_unchanged_after_failed_put(rig, case)
    assert_retry_stores(rig, case, rig.ingest(case.shard))


@pytest.mark.parametrize("case", list(PUT_CASES.values()), ids=list(PUT_CASES))
def test_a_failed_put_over_http_is_a_503_and_changes_nothing(make_rig: Callable[..., Rig], case: Case) -> None:
    rig = make_rig(case.backend, serve=True)
    rig.blobs.arm(case.point, case.error())
    with rig.http() as http:
        response = http.put(f"/v1/shards/{case.shard.shard_id}", content=case.shard.data)
        assert_storage_response(response, full=is_full_disk(case))
        assert case.shard.shard_id in response.json()["message"]
        assert_unchanged_after_failed_put(rig, case)
        missing = http.post("/v1/tensors/missing", json={"digests": case.shard.digests})
        assert missing.json() == {"missing": case.shard.digests}
        retry = http.put(f"/v1/shards/{case.shard.shard_id}", content=case.shard.data)
        assert retry.status_code == 201, retry.text
        assert_retry_stores(rig, case, retry.json())


@pytest.mark.parametrize("shard", [SMALL, BIG], ids=["written-at-the-end", "written-behind-the-upload"])
def test_a_full_staging_disk_while_receiving_an_upload_is_a_507_and_changes_nothing(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, shard: Shard
) -> None:
    # SMALL fits one staging buffer, written when the body is complete; BIG fills several, so
    # the failing write runs on a writer thread while the body is still arriving.
    rig = make_rig("local", serve=True)
    case = Case("local", "staging", lambda: os_error(errno.ENOSPC), shard)
    partial = fail_staging_writes(monkeypatch, os_error(errno.ENOSPC))
    with caplog.at_level(logging.ERROR, logger="ckptstore.api"), rig.http() as http:
        response = http.put(f"/v1/shards/{shard.shard_id}", content=shard.data)
        assert_storage_response(response, full=True)  # a full disk is no passing outage: 507, not retried
        message = response.json()["message"]
        assert "staging" in message and "ckptstore gc" in message  # what is full, and what to run
        assert any("No space left on device" in record.getMessage() for record in caplog.records)
        ((path, size, thread),) = partial
        assert size > 0 and not path.exists()
        assert thread.startswith("ckptstore-write") is (shard is BIG)
        assert rig.leftovers() == [] and rig.stored() == []
        assert rig.store.missing(shard.digests) == shard.digests
        retry = http.put(f"/v1/shards/{shard.shard_id}", content=shard.data)
        assert retry.status_code == 201, retry.text
        assert_retry_stores(rig, case, retry.json())


@pytest.mark.parametrize("case", list(READ_CASES.values()), ids=list(READ_CASES))
def test_a_failed_read_through_the_engine_is_a_storage_error_and_changes_nothing(
    make_rig: Callable[..., Rig], case: Case
) -> None:
    rig = make_rig(case.backend)
    rig.ingest(case.shard)
    for fired, read in enumerate(
        [lambda: rig.read(case.shard), lambda: b"".join(rig.store.iter_shard(case.shard.shard_id, 3, 2000))], start=1
    ):
        rig.blobs.arm(case.point, case.error())
        with pytest.raises(StorageError) as caught:
            read()
        assert rig.blobs.fired == fired
        assert case.shard.shard_id in str(caught.value)
    assert rig.stored() == [case.shard.shard_id]
    assert rig.store.missing(case.shard.digests) == []
    assert rig.leftovers() == []
    assert rig.read(case.shard) == case.shard.data


@pytest.mark.parametrize("case", list(READ_CASES.values()), ids=list(READ_CASES))
def test_a_failed_read_over_http_is_a_503_and_changes_nothing(make_rig: Callable[..., Rig], case: Case) -> None:
    rig = make_rig(case.backend, serve=True)
    rig.ingest(case.shard)
    path = f"/v1/shards/{case.shard.shard_id}"
    with rig.http() as http:
        for fired, headers in enumerate([{}, {"Range": "bytes=100-1099"}], start=1):
            rig.blobs.arm(case.point, case.error())
            assert_storage_response(http.get(path, headers=headers))
            assert rig.blobs.fired == fired
        # The client's transport (no retries, so no waiting) turns the 503 into StorageError.
        rig.blobs.arm(case.point, case.error())
        transport = HttpTransport(rig.url, ADMIN_TOKEN, retries=0)
        try:
            with pytest.raises(StorageError):
                transport.read_into(case.shard.shard_id, 0, memoryview(bytearray(len(case.shard.data))))
        finally:
            transport.close()
        assert rig.blobs.fired == 3
        assert rig.stored() == [case.shard.shard_id] and rig.leftovers() == []
        assert http.post("/v1/tensors/missing", json={"digests": case.shard.digests}).json() == {"missing": []}
        whole = http.get(path)
        assert whole.status_code == 200 and whole.content == case.shard.data
        ranged = http.get(path, headers={"Range": "bytes=100-1099"})
        assert ranged.status_code == 206 and ranged.content == case.shard.data[100:1100]


def test_a_fault_point_for_another_backend_is_refused(tmp_path: Path) -> None:
    blobs = FaultyBlobStore(LocalBlobStore(tmp_path / "blobs"))
    with pytest.raises(TypeError, match="S3BlobStore"):
        blobs.arm("upload-part", _s3_refusal())
