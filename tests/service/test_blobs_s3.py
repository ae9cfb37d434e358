"""S3BlobStore: the blob store contract and S3-specific behaviour, on a real moto S3 server."""

from __future__ import annotations

import random
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from test_blobs import BlobStoreContract, blob_id, payload

from ckptstore.service.blobs import BlobStore
from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.errors import InvalidInputError, NotFoundError, StorageError
from ckptstore.service.factory import open_blob_store
from ckptstore.service.settings import Settings

PART_BYTES = 5 << 20  # the smallest part S3 accepts


@pytest.fixture(scope="module")
def boto_session(s3_endpoint: str) -> Any:
    """One session for the module's clients: each fresh session parses botocore's S3 model again."""
    return boto3.session.Session()


@pytest.fixture
def client(s3_endpoint: str, boto_session: Any) -> Any:
    """A client with the store's settings, fresh per test so event hooks do not leak."""
    return make_client(s3_endpoint, session=boto_session)


@pytest.fixture(scope="module")
def s3_client(s3_endpoint: str, boto_session: Any) -> Any:
    """A plain client for setting up and inspecting buckets behind the store's back."""
    return make_client(s3_endpoint, session=boto_session)


@pytest.fixture
def bucket(s3_client: Any) -> Iterator[str]:
    """A fresh, uniquely named bucket, emptied and removed after the test."""
    name = f"ckpt-{uuid.uuid4().hex}"
    s3_client.create_bucket(Bucket=name)
    yield name
    for upload in s3_client.list_multipart_uploads(Bucket=name).get("Uploads", []):
        s3_client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for item in page.get("Contents", []):
            s3_client.delete_object(Bucket=name, Key=item["Key"])
    s3_client.delete_bucket(Bucket=name)


def keys(s3_client: Any, bucket: str) -> list[str]:
    return [item["Key"] for item in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def record_requests(client: Any, operation: str) -> list[dict[str, str]]:
    """Headers of every ``operation`` request the client sends from now on."""
    seen: list[dict[str, str]] = []

    def hook(request: Any, **_: Any) -> None:
        seen.append({name.lower(): value for name, value in request.headers.items()})

    client.meta.events.register(f"before-send.s3.{operation}", hook)
    return seen


class TestS3BlobStore(BlobStoreContract):
    @pytest.fixture
    def blobs(self, tmp_path: Path, bucket: str, client: Any) -> BlobStore:
        return S3BlobStore(bucket, "store", client=client)

    @pytest.mark.parametrize(
        ("prefix", "expected"),
        [("", ""), ("team/run-1", "team/run-1/"), ("/slashes/", "slashes/")],
    )
    def test_keys_fan_out_under_the_prefix(
        self, bucket: str, client: Any, s3_client: Any, tmp_path: Path, prefix: str, expected: str
    ) -> None:
        store = S3BlobStore(bucket, prefix, client=client)
        name = blob_id(1)
        store.put_file(name, write(tmp_path / "shard", payload(1)))
        assert keys(s3_client, bucket) == [f"{expected}{name[:2]}/{name}"]
        body = s3_client.get_object(Bucket=bucket, Key=f"{expected}{name[:2]}/{name}")["Body"].read()
        assert body == payload(1)

    def test_multipart_upload_reads_back_and_leaves_no_parts(
        self, bucket: str, client: Any, s3_client: Any, tmp_path: Path
    ) -> None:
        store = S3BlobStore(bucket, "big", client=client, part_bytes=PART_BYTES)
        data = random.Random(7).randbytes(2 * PART_BYTES + (1 << 20))  # 11 MiB: three parts
        source = write(tmp_path / "big.incomplete", data)
        store.put_file(blob_id(1), source)
        head = s3_client.head_object(Bucket=bucket, Key=f"big/{blob_id(1)[:2]}/{blob_id(1)}")
        assert head["ETag"].strip('"').endswith("-3")  # S3's mark of an object built from three parts
        assert "Uploads" not in s3_client.list_multipart_uploads(Bucket=bucket)
        assert store.size(blob_id(1)) == len(data)
        buffer = bytearray(len(data))
        store.read_into(blob_id(1), 0, memoryview(buffer))
        assert buffer == data
        around_a_part_edge = PART_BYTES - 100
        pieces = list(store.iter_range(blob_id(1), around_a_part_edge, 300, chunk_bytes=128))
        assert b"".join(pieces) == data[around_a_part_edge : around_a_part_edge + 300]

    def test_failed_multipart_upload_leaves_no_object_and_no_parts(
        self, bucket: str, client: Any, s3_client: Any, tmp_path: Path
    ) -> None:
        def fail_second_part(params: dict[str, Any], **_: Any) -> None:
            if params.get("PartNumber") == 2:
                raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "UploadPart")

        client.meta.events.register("before-parameter-build.s3.UploadPart", fail_second_part)
        store = S3BlobStore(bucket, "big", client=client, part_bytes=PART_BYTES)
        source = write(tmp_path / "big.incomplete", random.Random(8).randbytes(2 * PART_BYTES + 1))
        with pytest.raises(StorageError, match=f"{bucket}/big/{blob_id(1)[:2]}/{blob_id(1)}") as caught:
            store.put_file(blob_id(1), source)
        assert "injected" in str(caught.value)
        assert store.size(blob_id(1)) is None
        assert keys(s3_client, bucket) == []
        assert "Uploads" not in s3_client.list_multipart_uploads(Bucket=bucket)

    def test_put_of_a_present_blob_sends_no_upload(self, blobs: S3BlobStore, source: Path, tmp_path: Path) -> None:
        puts = record_requests(blobs.client, "PutObject")
        blobs.put_file(blob_id(1), source)
        assert len(puts) == 1
        blobs.put_file(blob_id(1), write(tmp_path / "again", payload(1)))
        assert len(puts) == 1

    def test_prefixes_isolate_stores_in_one_bucket(self, bucket: str, client: Any, tmp_path: Path) -> None:
        # "run" is a string prefix of "run-2": the separator must keep them apart.
        first = S3BlobStore(bucket, "run", client=client)
        second = S3BlobStore(bucket, "run-2", client=client)
        root = S3BlobStore(bucket, "", client=client)
        first.put_file(blob_id(1), write(tmp_path / "one", payload(1)))
        second.put_file(blob_id(2), write(tmp_path / "two", payload(2)))
        assert list(first.list_ids()) == [blob_id(1)]
        assert list(second.list_ids()) == [blob_id(2)]
        assert list(root.list_ids()) == []  # other stores' keys sit one level too deep
        assert first.size(blob_id(2)) is None
        with pytest.raises(NotFoundError):
            second.read_into(blob_id(1), 0, memoryview(bytearray(1)))
        root.put_file(blob_id(1), write(tmp_path / "three", payload(3)))
        second.delete(blob_id(1))  # absent here: must not touch the other stores' copies
        first.delete(blob_id(2))
        assert list(root.list_ids()) == [blob_id(1)]
        assert first.size(blob_id(1)) == len(payload(1))
        assert second.size(blob_id(2)) == len(payload(2))

    def test_list_ids_ignores_stray_keys(self, blobs: S3BlobStore, bucket: str, s3_client: Any, source: Path) -> None:
        blobs.put_file(blob_id(1), source)
        misplaced = blob_id(2)
        folder = "zz" if misplaced[:2] != "zz" else "yy"
        for key in [
            f"store/{folder}/{misplaced}",
            f"store/{misplaced}",
            "store/notes.txt",
            f"store/{misplaced[:2]}/{misplaced}/nested",
        ]:
            s3_client.put_object(Bucket=bucket, Key=key, Body=b"stray")
        assert list(blobs.list_ids()) == [blob_id(1)]

    def test_list_ids_pages_through_many_keys(self, blobs: S3BlobStore, tmp_path: Path) -> None:
        ids = [blob_id(seed) for seed in range(5)]
        for seed, name in enumerate(ids):
            blobs.put_file(name, write(tmp_path / f"source-{seed}", payload(seed, 10)))
        lists = record_requests(blobs.client, "ListObjectsV2")
        # A two-key page size forces three pages without uploading a thousand objects.
        original = blobs.client.get_paginator

        def small_pages(name: str) -> Any:
            paginator = original(name)
            paginate = paginator.paginate
            paginator.paginate = lambda **kwargs: paginate(**kwargs, PaginationConfig={"PageSize": 2})
            return paginator

        blobs.client.get_paginator = small_pages
        assert list(blobs.list_ids()) == sorted(ids)
        assert len(lists) == 3

    def test_iter_range_is_one_request(self, blobs: S3BlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        gets = record_requests(blobs.client, "GetObject")
        pieces = list(blobs.iter_range(blob_id(1), 13, 300, chunk_bytes=7))
        assert b"".join(pieces) == data[13:313]
        assert len(gets) == 1
        assert gets[0]["range"] == b"bytes=13-312"

    def test_read_scatter_is_one_request(self, blobs: S3BlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        gets = record_requests(blobs.client, "GetObject")
        buffers = [bytearray(size) for size in (100, 0, 1, 199)]
        blobs.read_scatter(blob_id(1), 13, [memoryview(buffer) for buffer in buffers])
        assert b"".join(buffers) == data[13:313]
        assert len(gets) == 1
        assert gets[0]["range"] == b"bytes=13-312"

    def test_read_into_streams_the_body_in_chunks(
        self, blobs: S3BlobStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        data = payload(5, 1000)
        blobs.put_file(blob_id(5), write(tmp_path / "shard", data))
        monkeypatch.setattr("ckptstore.service.blobs.s3.READ_CHUNK_BYTES", 128)
        reads: list[int | None] = []
        get_object = blobs.client.get_object

        def spying_get_object(**kwargs: Any) -> Any:
            response = get_object(**kwargs)
            body = response["Body"]
            read = body.read

            def counted_read(amount: int | None = None) -> bytes:
                reads.append(amount)
                return read(amount)

            body.read = counted_read
            return response

        monkeypatch.setattr(blobs.client, "get_object", spying_get_object)
        buffer = bytearray(900)
        blobs.read_into(blob_id(5), 50, memoryview(buffer))
        assert buffer == data[50:950]
        assert reads and all(amount is not None and amount <= 128 for amount in reads)

    def test_empty_read_still_checks_presence(self, blobs: S3BlobStore, source: Path) -> None:
        with pytest.raises(NotFoundError, match=blob_id(1)):
            blobs.read_into(blob_id(1), 0, memoryview(bytearray(0)))
        blobs.put_file(blob_id(1), source)
        blobs.read_into(blob_id(1), len(payload(1)) + 5, memoryview(bytearray(0)))  # like a local file: no error


class TestS3Settings:
    @pytest.mark.parametrize("mode", ["when_required", "when_supported"])
    def test_checksum_setting_reaches_the_client(
        self, bucket: str, s3_endpoint: str, tmp_path: Path, mode: str
    ) -> None:
        store = S3BlobStore(bucket, endpoint_url=s3_endpoint, checksum=mode)
        config = store.client.meta.config
        assert (config.request_checksum_calculation, config.response_checksum_validation) == (mode, mode)
        assert config.retries["mode"] == "standard"
        assert config.max_pool_connections == 16
        puts = record_requests(store.client, "PutObject")
        store.put_file(blob_id(1), write(tmp_path / "shard", payload(1)))
        sent_a_checksum = any(name.startswith("x-amz-checksum-") for name in puts[0])
        assert sent_a_checksum == (mode == "when_supported")

    def test_factory_builds_the_store_from_a_url_and_aws_endpoint_url(
        self, bucket: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # boto3 reads it; the URL names no host
        settings = Settings(home=tmp_path / "home", s3_checksum="when_supported", s3_part_bytes=8 << 20)
        store = open_blob_store(f"s3://{bucket}/team/ckpts/", settings)
        assert isinstance(store, S3BlobStore)
        assert (store.bucket, store.prefix, store.part_bytes, store.checksum) == (
            bucket,
            "team/ckpts",
            8 << 20,
            "when_supported",
        )
        store.put_file(blob_id(1), write(tmp_path / "shard", payload(1)))
        assert list(store.list_ids()) == [blob_id(1)]

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"checksum": "always"}, "CKPTSTORE_S3_CHECKSUM"),
            ({"part_bytes": PART_BYTES - 1}, "CKPTSTORE_S3_PART_BYTES"),
            ({"part_bytes": (5 << 30) + 1}, "CKPTSTORE_S3_PART_BYTES"),
        ],
    )
    def test_bad_settings_are_refused(self, s3_endpoint: str, kwargs: dict[str, Any], message: str) -> None:
        with pytest.raises(InvalidInputError, match=message):
            S3BlobStore("bucket", endpoint_url=s3_endpoint, **kwargs)

    def test_a_bucket_is_required(self, s3_endpoint: str) -> None:
        with pytest.raises(InvalidInputError, match="bucket"):
            S3BlobStore("", "prefix", endpoint_url=s3_endpoint)


class TestS3Failures:
    def assert_all_operations_fail(self, store: S3BlobStore, source: Path, needle: str) -> None:
        """Every operation raises StorageError naming ``needle``, caused by a boto3/botocore error."""
        operations = {
            "put_file": lambda: store.put_file(blob_id(1), source),
            "size": lambda: store.size(blob_id(1)),
            "read_into": lambda: store.read_into(blob_id(1), 0, memoryview(bytearray(4))),
            "iter_range": lambda: list(store.iter_range(blob_id(1), 0, 4)),
            "delete": lambda: store.delete(blob_id(1)),
            "list_ids": lambda: list(store.list_ids()),
        }
        for name, operation in operations.items():
            with pytest.raises(StorageError, match=needle) as caught:
                operation()
            assert not isinstance(caught.value, NotFoundError), name
            assert isinstance(caught.value.__cause__, (BotoCoreError, ClientError, boto3.exceptions.Boto3Error)), name

    def test_missing_bucket_is_a_storage_error(self, client: Any, tmp_path: Path) -> None:
        missing = f"ckpt-missing-{uuid.uuid4().hex}"
        store = S3BlobStore(missing, "p", client=client)
        self.assert_all_operations_fail(store, write(tmp_path / "shard", payload(1)), missing)

    def test_unreachable_server_is_a_storage_error(self, boto_session: Any, tmp_path: Path) -> None:
        with socket.socket() as probe:  # a loopback port nobody listens on once the probe closes
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        client = boto_session.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", config=Config(retries={"total_max_attempts": 1})
        )
        store = S3BlobStore("bucket", "p", client=client)
        self.assert_all_operations_fail(store, write(tmp_path / "shard", payload(1)), "bucket")
