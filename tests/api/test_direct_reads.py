"""Loads through a server whose blobs are in S3 read shard bytes from S3 directly, through signed
URLs the server hands out (a real uvicorn server, a real moto S3 server); every byte is still
checked against its digest, and the server's own path serves whatever the URLs cannot."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import httpx
import pytest
import torch

from ckptstore import client
from ckptstore.service.api.app import create_app
from ckptstore.service.errors import IntegrityError
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.client.models import tensors_equal
from tests.servers import running_server

READ, WRITE = "r" * 32, "w" * 32


@dataclass
class Served:
    url: str
    store: Store
    bucket: str | None

    def shard_bytes_out(self) -> int:
        """Shard bytes the server itself has sent (its Prometheus counter)."""
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith('ckptstore_shard_bytes_total{direction="out"}'):
                return int(float(line.split()[-1]))
        return 0


@contextmanager
def serving(
    tmp_path: Path, endpoint: str | None, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> Iterator[Served]:
    """A server on S3 blobs in a fresh bucket (``endpoint`` given) or on a local folder."""
    bucket = None
    blobs = None
    if endpoint is not None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        blobs = f"s3://{bucket}/ckpt"
    config = Settings(home=tmp_path / "server", blobs=blobs, **settings)  # type: ignore[arg-type]
    store = open_store(config)
    try:
        with running_server(create_app(store, config)) as url:
            yield Served(url, store, bucket)
    finally:
        store.close()


def _model(seed: int) -> torch.nn.Module:
    """Two layers of 256 KiB and more: their shards' ranges are read from S3, not batched through the server."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 512))


def _saved(url: str, token: str | None = None) -> torch.nn.Module:
    model = _model(1)
    with client.Client(url, token=token) as ckpt:
        ckpt.save("run", model)
    return model


def _same(found: torch.nn.Module, expected: torch.nn.Module) -> bool:
    theirs = expected.state_dict()
    return all(tensors_equal(v, theirs[k]) for k, v in found.state_dict().items())


def test_a_load_reads_its_shards_from_s3_not_through_the_server(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(tmp_path, s3_endpoint, monkeypatch) as served:
        model = _saved(served.url)
        fresh = _model(5)
        with client.Client(served.url) as ckpt:
            ckpt.load("run", model=fresh)
            assert ckpt.transport.direct_reads.offered  # type: ignore[attr-defined]
        assert _same(fresh, model)
        assert served.shard_bytes_out() == 0


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Storage that refuses every read, as S3 refuses a URL whose signature has expired."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


def test_a_url_the_storage_refuses_is_asked_for_again(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(tmp_path, s3_endpoint, monkeypatch) as served, _refusing() as refusing:
        model = _saved(served.url)
        with client.Client(served.url) as ckpt:
            direct = ckpt.transport.direct_reads  # type: ignore[attr-defined]
            manifest = ckpt.transport.manifest("run")
            locations = ckpt.transport.locate(e.digest for e in manifest.tensors if e.digest)
            for shard, (url, deadline) in list(direct._urls.items()):  # every URL now one storage refuses
                direct._urls[shard] = (urlsplit(url)._replace(netloc=refusing).geturl(), deadline)
            fresh = _model(5)
            ckpt.load("run", model=fresh)
            assert all(urlsplit(url).netloc != refusing for url, _ in direct._urls.values())
            assert {loc.shard_id for loc in locations.values()} <= direct._urls.keys()
        assert _same(fresh, model) and served.shard_bytes_out() == 0


@contextmanager
def _refusing() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_bytes_changed_in_s3_fail_the_load_by_their_digest(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(tmp_path, s3_endpoint, monkeypatch) as served:
        _saved(served.url)
        s3 = boto3.client("s3", endpoint_url=s3_endpoint)
        key = max(s3.list_objects_v2(Bucket=served.bucket, Prefix="ckpt/")["Contents"], key=lambda o: o["Size"])["Key"]
        data = bytearray(s3.get_object(Bucket=served.bucket, Key=key)["Body"].read())
        data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # the last tensor's last bytes, same length
        s3.put_object(Bucket=served.bucket, Key=key, Body=bytes(data))
        with client.Client(served.url) as ckpt, pytest.raises(IntegrityError):
            ckpt.load("run", model=_model(5))


@pytest.mark.parametrize("where", ["local-disk", "s3-urls-off"])
def test_without_urls_the_server_serves_reads_itself(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    endpoint = None if where == "local-disk" else s3_endpoint
    with serving(tmp_path, endpoint, monkeypatch, read_url_seconds=0) as served:
        model = _saved(served.url)
        fresh = _model(5)
        with client.Client(served.url) as ckpt:
            ckpt.load("run", model=fresh)
            assert not ckpt.transport.direct_reads.offered  # type: ignore[attr-defined]
        assert _same(fresh, model) and served.shard_bytes_out() > 0


def test_urls_need_the_read_scope_name_shards_and_expire_as_set(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = f"read:{READ},write:{WRITE}"
    with serving(tmp_path, s3_endpoint, monkeypatch, tokens=tokens, read_url_seconds=120) as served:
        _saved(served.url, token=WRITE)
        shard = served.store.blobs.list_ids().__next__()
        ask = f"{served.url}/v1/shards/urls"
        assert httpx.post(ask, json={"shards": [shard]}).status_code == 401
        answer = httpx.post(ask, json={"shards": [shard]}, headers={"Authorization": f"Bearer {READ}"})
        assert answer.status_code == 200 and answer.json()["expires_in"] == 120
        query = parse_qs(urlsplit(answer.json()["urls"][shard]).query)
        assert query["X-Amz-Expires"] == ["120"]
        for bad, status in ((["../../etc/passwd"], 422), (["A" * 64], 422), ([shard] * 1025, 413)):
            refused = httpx.post(ask, json={"shards": bad}, headers={"Authorization": f"Bearer {READ}"})
            assert refused.status_code == status and "shards" in refused.json()["message"], bad[:1]


def test_signed_urls_reach_no_log(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(tmp_path, s3_endpoint, monkeypatch) as served, caplog.at_level(logging.DEBUG):
        _saved(served.url)
        with client.Client(served.url) as ckpt:
            direct = ckpt.transport.direct_reads  # type: ignore[attr-defined]
            manifest = ckpt.transport.manifest("run")
            locations = ckpt.transport.locate(e.digest for e in manifest.tensors if e.digest)
            shard = next(iter(locations.values())).shard_id
            url, deadline = direct._urls[shard]
            with socket.socket() as probe:  # a port nothing listens on once closed
                probe.bind(("127.0.0.1", 0))
                dead = f"127.0.0.1:{probe.getsockname()[1]}"
            direct._urls[shard] = (urlsplit(url)._replace(netloc=dead).geturl(), deadline)
            ckpt.load("run", model=_model(5))  # that read fails over to the server, logged masked
            assert served.shard_bytes_out() > 0
    ours = ("ckptstore", "uvicorn", "httpx", "httpcore")  # not the S3 stand-in's own access log
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.split(".")[0] in ours)
    assert "shard bytes from" in text  # the failed read was logged, its URL masked
    assert "X-Amz-Signature=" not in text.replace("X-Amz-Signature=***", "")
