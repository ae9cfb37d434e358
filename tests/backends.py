"""Real backends for tests: a moto S3 server and fresh PostgreSQL databases."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from ckptstore.service.db import Database
from ckptstore.service.db.models import Base

# Variables that would point boto3 at a real account, profile or endpoint, or change its checksums.
AWS_VARIABLES_TO_CLEAR = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)

#: A database on the server the tests use, as a role allowed to CREATE DATABASE; the tests make
#: and drop their own databases beside it. CI may point this at another server.
POSTGRES_URL = os.environ.get("CKPTSTORE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@contextmanager
def moto_server(scratch: Path) -> Iterator[str]:
    """A real S3-compatible HTTP server (moto) on a free loopback port; yields its URL.

    While it runs the environment holds dummy credentials and no AWS profile, config file or
    endpoint, so any boto3 client built from it is hermetic.
    """
    from moto.server import ThreadedMotoServer  # imported here: only S3 tests pay for it

    absent = scratch / "absent"
    with pytest.MonkeyPatch.context() as patch:
        for name in AWS_VARIABLES_TO_CLEAR:
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


def empty_tables(database: Database) -> None:
    """Delete every row the store keeps (the schema revision stays)."""
    tables = ", ".join(f'"{table.name}"' for table in Base.metadata.sorted_tables)
    with database.engine.begin() as connection:
        connection.exec_driver_sql(f"TRUNCATE {tables}")


def leave_upload_unfinished(s3: Any, bucket: str, key: str, parts: Sequence[bytes]) -> str:
    """Start a multipart upload of ``key`` and send ``parts``, as a writer killed before
    completing it would leave it; returns its upload id."""
    upload_id = str(s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])
    for number, data in enumerate(parts, start=1):
        s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
    return upload_id


def unfinished_uploads(s3: Any, bucket: str) -> dict[str, str]:
    """Upload id -> key of every incomplete multipart upload in ``bucket``."""
    pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket)
    return {item["UploadId"]: item["Key"] for page in pages for item in page.get("Uploads", ())}
