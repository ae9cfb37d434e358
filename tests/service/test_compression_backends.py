"""Compression through every way to a store: the same versions load bit for bit before and after
``gc(compress=True)`` embedded and over HTTP (a real uvicorn server), on SQLite with local blobs
and on PostgreSQL with S3 blobs (a real moto server, where loads read payloads from S3 directly);
and ``ckptstore gc --compress`` reports what it did, a dry run exactly what a run then does;
``verify`` and ``export`` read the compressed versions."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest
import torch
from compression_kit import (
    BELOW,
    LARGE_KEYS,
    FineTune,
    a_pinned_shard,
    blob_bytes,
    large_digests,
    shard_ids,
    uncompressed_versions,
)
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckptstore.client.progress  # noqa: F401  (binds client.progress for the name below)
from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.service.api import create_app
from ckptstore.service.blobs import BlobStore
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import empty_tables
from tests.client.models import tensors_equal
from tests.servers import running_server


@dataclass
class Ways:
    """One store, reached embedded and through a server."""

    store: Store
    embedded: client.Client
    remote: client.Client
    url: str

    @property
    def blobs(self) -> BlobStore:
        return self.store.blobs

    def bytes_served(self) -> int:
        """Shard bytes the server itself has sent (its Prometheus counter)."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith('ckptstore_shard_bytes_total{direction="out"}'):
                return int(float(line.split()[-1]))
        return 0


@pytest.fixture(params=["sqlite-local", "postgresql-s3"])
def ways(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ways]:
    """An empty store, with an embedded client and a client of a server on it."""
    home = tmp_path / "home"
    if request.param == "sqlite-local":
        settings = Settings(home=home)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        url = request.getfixturevalue("pg_url")
        database = Database(url)
        empty_tables(database)
        database.dispose()
        blobs = f"s3://{bucket}/ckpt"
        settings = Settings(home=home, database_url=url, blobs=blobs)
        # An embedded client opens the store these name, as a training job on the server's store does.
        monkeypatch.setenv("CKPTSTORE_DATABASE_URL", url)
        monkeypatch.setenv("CKPTSTORE_BLOBS", blobs)
        monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    store = open_store(settings)
    embedded = client.Client(home=home) if settings.database_url is None else client.Client()
    try:
        with running_server(create_app(store, settings)) as url, client.Client(url) as remote:
            yield Ways(store, embedded, remote, url)
    finally:
        embedded.close()
        store.close()


def test_the_same_versions_load_bit_for_bit_every_way_before_and_after_compression(
    ways: Ways, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tunes = {"bf16": FineTune(torch.bfloat16), "fp32": FineTune(torch.float32)}
    for step in range(3):
        for run, tune in tunes.items():
            tune.save(ways.remote if step % 2 else ways.embedded, run)  # a run saved both ways
    for way in (ways.embedded, ways.remote):
        assert not any(tune.wrong_loads(way, run) for run, tune in tunes.items())
    before = blob_bytes(ways.blobs)

    monkeypatch.setattr(client.progress, "bars_enabled", lambda: True)  # as on a terminal
    capsys.readouterr()
    report = ways.remote.gc(compress=True, grace_seconds=0)

    assert "compress" not in capsys.readouterr().err  # the server did the work: no bar here
    assert report.versions_compressed == 6 and report.tensors_compressed == 6 * len(LARGE_KEYS)
    assert 0 < report.tensors_as_deltas and report.bytes_after_compression < report.bytes_before_compression / 2
    assert blob_bytes(ways.blobs) < before - (report.bytes_before_compression - report.bytes_after_compression) / 2
    digests = large_digests(ways.remote.transport, "fp32", 3)
    located = ways.remote.transport.locate(digests.values())
    assert all(located[d].encoded for d in digests.values())
    served = ways.bytes_served()
    for way in (ways.embedded, ways.remote):
        assert not any(tune.wrong_loads(way, run) for run, tune in tunes.items())
    if ways.store.blobs.location.startswith("s3://"):
        # The payloads came from S3 through signed URLs; the server sent at most the small raw tensors.
        assert ways.remote.transport.direct_reads.offered  # type: ignore[attr-defined]
        assert ways.bytes_served() - served < report.bytes_after_compression / 10


def cli(home: Path, *args: str) -> str:
    """``ckptstore ARGS`` on the embedded store in ``home``; its output, once it succeeded."""
    env = {"CKPTSTORE_URL": None, "CKPTSTORE_HOME": str(home), "CKPTSTORE_TOKEN": None}
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    return result.stdout


FIGURES = (
    "versions_compressed",
    "tensors_compressed",
    "tensors_as_deltas",
    "bytes_before_compression",
    "bytes_after_compression",
)


def test_an_encoded_shard_is_compacted_through_the_server_and_loads_every_way(ways: Ways) -> None:
    tune, pinned = a_pinned_shard(ways.store, ways.remote)

    report = ways.remote.gc(grace_seconds=0, compact_below=BELOW)

    assert (report.shards_compacted, report.shards_swept) == (1, 1)
    assert pinned not in shard_ids(ways.store) and set(ways.blobs.list_ids()) == shard_ids(ways.store)
    for way in (ways.embedded, ways.remote):
        assert tune.wrong_loads(way) == {}


def test_gc_compress_on_the_command_line_reports_what_it_did_and_a_dry_run_what_it_would(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tune = FineTune(torch.bfloat16)
    with client.Client(home=home) as ckpt:
        for _ in range(3):
            tune.save(ckpt, "run")
        store = ckpt.transport
        assert isinstance(store, Store)
        blobs = {blob_id: store.blobs.size(blob_id) for blob_id in store.blobs.list_ids()}

        dry = json.loads(cli(home, "gc", "--compress", "--grace", "0", "--dry-run", "--json"))

        assert dry["dry_run"] is True and dry["versions_compressed"] == 3
        assert dry["tensors_compressed"] == 3 * len(LARGE_KEYS) and dry["tensors_as_deltas"] > 0
        assert 0 < dry["bytes_after_compression"] < dry["bytes_before_compression"] / 2
        assert {blob_id: store.blobs.size(blob_id) for blob_id in store.blobs.list_ids()} == blobs
        assert len(uncompressed_versions(store)) == 3

        done = json.loads(cli(home, "gc", "--compress", "--grace", "0", "--json"))

        assert done["dry_run"] is False and {k: done[k] for k in FIGURES} == {k: dry[k] for k in FIGURES}
        assert done["shards_swept"] > 0 and uncompressed_versions(store) == []
        assert blob_bytes(store.blobs) < sum(size or 0 for size in blobs.values()) / 2
        assert tune.wrong_loads(ckpt) == {}

        text = cli(home, "gc", "--compress", "--grace", "0")

        assert "compressed 0 tensors of 0 versions (0 as deltas)" in text
        verified = cli(home, "verify")
        assert verified.startswith("verified 3 versions")
        cli(home, "export", "run@2", str(tmp_path / "export"))
        exported = load_file(tmp_path / "export" / "model.safetensors")
        saved = tune.saved[("run", 2)].model
        assert exported.keys() == saved.keys()
        assert all(tensors_equal(exported[key], value) for key, value in saved.items())
