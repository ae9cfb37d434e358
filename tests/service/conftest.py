"""Fixtures for the engine tests: a store (SQLite, PostgreSQL) in a temporary home, a shard ingester,
an S3 server, fresh PostgreSQL databases."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from shardkit import BuiltShard, Ingest, RawTensor, build_shard
from sqlalchemy.engine import make_url

from service.blobs import LocalBlobStore
from service.db import Database, schema
from service.db.models import Base
from service.records import ShardReceipt
from service.store import Store


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The embedded store's folder."""
    return tmp_path / "home"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, home: Path) -> Iterator[Store]:
    """An empty store with local blobs in a fresh folder: embedded SQLite, then PostgreSQL."""
    opened = Store.open_home(home) if request.param == "sqlite" else postgres_store(request, home)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def ingest(store: Store) -> Ingest:
    """Build a shard of the given tensors, write it to staging and ingest it."""

    def run(*tensors: RawTensor) -> tuple[BuiltShard, ShardReceipt]:
        shard = build_shard(tensors)
        receipt = store.ingest_file(shard.write(store.staging_path()))
        return shard, receipt

    return run


# Variables that would point boto3 at a real account, profile or endpoint, or change its checksums.
_AWS_VARIABLES_TO_CLEAR = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real S3-compatible HTTP server (moto) on a free loopback port.

    For the rest of the session the environment holds dummy credentials and no AWS profile,
    config file or endpoint, so any boto3 client built from it is hermetic. Tests create their
    own uniquely named buckets; the server is shared.
    """
    from moto.server import ThreadedMotoServer  # imported here: only S3 tests pay for it

    absent = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as patch:
        for name in _AWS_VARIABLES_TO_CLEAR:
            patch.delenv(name, raising=False)
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_CONFIG_FILE", str(absent))
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(absent))
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


# -- PostgreSQL ---------------------------------------------------------------------------------

#: A database on the server the tests use, as a role allowed to CREATE DATABASE; the tests make
#: and drop their own databases beside it. CI may point this at another server.
POSTGRES_URL = os.environ.get("CKPTSTORE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


class PostgresDatabases:
    """Makes brand-new databases ``ckptstore_test_<hex>`` on the test server; drops them all at the end."""

    def __init__(self, base_url: str) -> None:
        self.base_url = make_url(base_url)
        self.names: list[str] = []

    def _admin(self) -> psycopg.Connection:
        conninfo = self.base_url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            return psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            pytest.fail(
                f"PostgreSQL at {self.base_url} is unreachable ({exc}); start it (see .ci/run) "
                "or point CKPTSTORE_TEST_POSTGRES at a server where this role may create databases"
            )

    def create(self) -> str:
        """The URL of a new, empty database."""
        name = f"ckptstore_test_{uuid.uuid4().hex}"
        with self._admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.names.append(name)
        return self.base_url.set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        """Drop every database made here, closing any connection left to it."""
        with self._admin() as admin:
            for name in self.names:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.names.clear()


@pytest.fixture(scope="session")
def postgres_databases() -> Iterator[PostgresDatabases]:
    """Maker of fresh PostgreSQL databases, each dropped when the session ends."""
    databases = PostgresDatabases(POSTGRES_URL)
    try:
        yield databases
    finally:
        databases.drop_all()


@pytest.fixture(scope="session")
def pg_url(postgres_databases: PostgresDatabases) -> str:
    """A fresh PostgreSQL database for this session, migrated to the newest schema."""
    url = postgres_databases.create()
    database = Database(url)
    try:
        schema.upgrade(database)
    finally:
        database.dispose()
    return url


def empty_tables(database: Database) -> None:
    """Delete every row the store keeps (the schema revision stays)."""
    tables = ", ".join(f'"{table.name}"' for table in Base.metadata.sorted_tables)
    with database.engine.begin() as connection:
        connection.exec_driver_sql(f"TRUNCATE {tables}")


def postgres_store(request: pytest.FixtureRequest, home: Path) -> Store:
    """A store on the session's PostgreSQL database, emptied, with blobs and staging under ``home``."""
    database = Database(request.getfixturevalue("pg_url"))
    empty_tables(database)
    return Store(database, LocalBlobStore(home / "blobs"), home / "staging")
