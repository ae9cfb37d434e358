"""Which store the CLI and ``Client()`` open without ``CKPTSTORE_URL``: the one ``ckptstore serve``
would open (``CKPTSTORE_DATABASE_URL`` + ``CKPTSTORE_BLOBS``), and never a store made on the spot.

The operator's case: on a server host with PostgreSQL and S3 configured, ``ckptstore verify``
used to check a brand-new empty SQLite store in ``CKPTSTORE_HOME`` and report success.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.service.db import Database, schema
from ckptstore.service.factory import open_store
from ckptstore.service.format.dtypes import byte_length
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import PostgresDatabases
from tests.client.models import TinyNet, train

ROOT = Path(__file__).resolve().parents[2]
#: Every variable that can name a store; each test sets exactly the ones it means.
STORE_VARIABLES = ("CKPTSTORE_URL", "CKPTSTORE_TOKEN", "CKPTSTORE_HOME", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS")


def invoke(*args: str, input: str | None = None) -> Result:
    """Run ``ckptstore`` in-process with the current environment; never a traceback."""
    result = CliRunner().invoke(app, list(args), input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def ok(*args: str) -> str:
    """Run a command that must succeed; its stdout."""
    result = invoke(*args)
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture
def bare_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No store variable set and a fresh user home (so ``~/.ckptstore`` is ``<tmp>/user/.ckptstore``)."""
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("HOME", str(user))
    return user


@dataclass
class ServerStore:
    """A PostgreSQL database and an S3 bucket as a server's settings name them."""

    database_url: str
    bucket: str
    prefix: str
    s3: object

    @property
    def blobs(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @contextmanager
    def open(self, home: Path) -> Iterator[Store]:
        """The store as ``ckptstore serve`` opens it (a separate view, for checking)."""
        store = open_store(Settings(home=home, database_url=self.database_url, blobs=self.blobs))
        try:
            yield store
        finally:
            store.close()

    def object_keys(self) -> set[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)  # type: ignore[attr-defined]
        return {item["Key"] for page in pages for item in page.get("Contents", ())}


@pytest.fixture
def server_store(
    postgres_databases: PostgresDatabases, s3_endpoint: str, bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerStore]:
    """A migrated PostgreSQL database and an S3 bucket, named by the environment the way docs/server.md's
    production section names them (and no ``CKPTSTORE_URL``)."""
    url = postgres_databases.create()
    database = Database(url)
    schema.upgrade(database)
    database.dispose()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket)
    store = ServerStore(url, bucket, "ckpt", s3)
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", url)
    monkeypatch.setenv("CKPTSTORE_BLOBS", store.blobs)
    yield store


def save_three(ckpt: client.Client) -> None:
    """Two versions of ``run`` (the second after a step) and one of ``other``."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(1))
    ckpt.save("run", model, optim, step=1)
    train(model, optim, range(1, 2))
    ckpt.save("run", model, optim, step=2)
    ckpt.save("other", TinyNet(seed=5), step=7)


@pytest.mark.slow  # the CLI against PostgreSQL and S3, several commands
def test_verify_ls_and_gc_work_on_the_configured_postgres_and_s3_store(
    server_store: ServerStore, bare_env: Path
) -> None:
    with client.Client() as ckpt:  # no URL, no home: the store the environment names
        assert isinstance(ckpt.transport, Store)
        save_three(ckpt)
    home = bare_env / ".ckptstore"
    with server_store.open(bare_env / "check") as store:
        manifests = [store.manifest(run, v) for run, v in (("run", 1), ("run", 2), ("other", 1))]
        shard_ids = set(store.blobs.list_ids())
    assert shard_ids and {k.rsplit("/", 1)[-1] for k in server_store.object_keys()} == shard_ids
    assert not (home / "metadata.db").exists()  # nothing went to an embedded store

    # The operator's command, as a separate process with the server's environment.
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", "verify", "--json"],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    unique = {t.digest: t for m in manifests for t in m.tensors}
    assert report["ok"] is True and report["versions"] == 3
    assert report["tensors"] == sum(len(m.tensors) for m in manifests)
    assert report["digests"] == len(unique)
    assert report["bytes"] == sum(byte_length(t.dtype, list(t.shape)) for t in unique.values()) > 0
    assert server_store.blobs in report["store"] and "postgresql" in report["store"]
    assert not (home / "metadata.db").exists()

    text = ok("verify")
    assert text.startswith("verified 3 versions: ") and "store: postgresql+psycopg://" in text
    assert server_store.blobs in text

    runs = json.loads(ok("ls", "--json"))
    assert sorted((r["run_id"], r["versions"]) for r in runs) == [("other", 1), ("run", 2)]
    assert [v["step"] for v in json.loads(ok("ls", "run", "--json"))] == [1, 2]
    assert json.loads(ok("show", "run@2", "--json"))["version"]["step"] == 2

    assert "deleted run@1" in ok("rm", "run@1", "-y")
    only_first = {t.digest for t in manifests[0].tensors} - {t.digest for m in manifests[1:] for t in m.tensors}
    assert only_first  # the step changed the weights and optimizer state
    report = json.loads(ok("gc", "--grace", "0", "--json"))
    assert report["shards_swept"] >= 1 and report["tensors_swept"] == len(only_first)
    with server_store.open(bare_env / "check") as store:
        left = set(store.blobs.list_ids())
    assert left < shard_ids and {k.rsplit("/", 1)[-1] for k in server_store.object_keys()} == left
    after = json.loads(ok("verify", "--json"))
    assert after["ok"] and after["versions"] == 2
    assert not (home / "metadata.db").exists()


def test_the_module_functions_save_to_the_configured_store(server_store: ServerStore, bare_env: Path) -> None:
    client.save("modfn", TinyNet(seed=2), step=3)
    assert [v.step for v in client.versions("modfn")] == [3]
    with server_store.open(bare_env / "check") as store:
        assert [v.step for v in store.versions("modfn")] == [3]
    assert not (bare_env / ".ckptstore" / "metadata.db").exists()


COMMANDS_THAT_READ = (
    ("verify",),
    ("verify", "--json"),
    ("ls",),
    ("ls", "--json"),
    ("ls", "run"),
    ("show", "run"),
    ("diff", "run@1", "run@2"),
    ("gc",),
    ("gc", "--dry-run", "--json"),
    ("retention", "run"),
    ("rm", "run@1", "-y"),
    ("tag", "run@1", "best"),
    ("untag", "run", "best"),
)


def assert_refused(result: Result) -> None:
    assert result.exit_code == 1, result.stdout
    assert result.stdout == "" or not result.stdout.lstrip().startswith(("verified", "{", "[", "swept"))
    message = result.stderr
    assert message.startswith("error: no checkpoint store here"), message
    for variable in ("CKPTSTORE_URL", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS", "CKPTSTORE_HOME"):
        assert variable in message
    assert "Nothing was created" in message


@pytest.mark.parametrize("command", COMMANDS_THAT_READ, ids=" ".join)
def test_with_nothing_configured_a_command_refuses_and_creates_nothing(bare_env: Path, command: tuple[str]) -> None:
    assert_refused(invoke(*command))
    assert list(bare_env.iterdir()) == []  # no ~/.ckptstore


def test_a_home_that_holds_no_store_is_refused_not_created(bare_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = bare_env / "nowhere" / "store"
    monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    assert_refused(invoke("verify", "--json"))
    assert_refused(invoke("gc", "--orphans"))
    assert not (bare_env / "nowhere").exists()
    with pytest.raises(client.NotFoundError, match="CKPTSTORE_DATABASE_URL"):
        client.Client(create=False)
    assert not (bare_env / "nowhere").exists()


@pytest.mark.slow  # a subprocess importing the client
def test_the_refusal_holds_in_a_separate_process(bare_env: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", "verify", "--json"],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "CKPTSTORE_URL" in done.stderr and "CKPTSTORE_DATABASE_URL" in done.stderr and "Traceback" not in done.stderr
    assert list(bare_env.iterdir()) == []


def test_import_still_creates_an_embedded_store(
    bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(weights))
    home = tmp_path / "fresh"
    monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    ok("import", str(weights), "base")
    assert (home / "metadata.db").is_file()
    assert json.loads(ok("verify", "--json"))["versions"] == 1


def test_an_unmigrated_server_database_is_refused_naming_the_upgrade(
    postgres_databases: PostgresDatabases, bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", postgres_databases.create())  # empty: no schema
    monkeypatch.setenv("CKPTSTORE_BLOBS", (tmp_path / "blobs").as_uri())
    for command in (("verify", "--json"), ("ls",), ("gc", "--dry-run")):
        result = invoke(*command)
        assert result.exit_code == 1 and "ckptstore db upgrade" in result.stderr, result.stderr
        assert result.stdout == ""
    assert not (tmp_path / "blobs").exists() and list(bare_env.iterdir()) == []


def test_empty_variables_count_as_unset(bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("CKPTSTORE_URL", "CKPTSTORE_HOME", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS"):
        monkeypatch.setenv(name, "")
    result = invoke("ls")
    assert_refused(result)
    assert str(bare_env / ".ckptstore") in result.stderr  # the default home, not the current folder
    assert list(bare_env.iterdir()) == [] and not (tmp_path / "metadata.db").exists()
