"""Secrets in the configured URLs never reach a terminal or a log: ``ckptstore serve`` (its start
line and its log), ``ckptstore db upgrade``, ``verify``'s ``store:`` line and error messages show
them masked.

The database is a real PostgreSQL one with trust authentication, so a URL carrying passwords in
its user-info and its query still connects; an S3 endpoint URL with credentials is one that
cannot be reached, so the error quoting it is shown.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from ckptstore.client.cli import app
from ckptstore.service.db import Database, schema
from tests.api.served_process import serve_process
from tests.backends import PostgresDatabases

USERINFO_SECRET = "Hunter2InTheUserInfo"
QUERY_SECRET = "Hunter2InThePasswordParameter"
SSL_SECRET = "Hunter2InTheSslpassword"
KEY_SECRET = "Hunter2InTheApiKey"
S3_SECRET = "Hunter2InTheS3Endpoint"
SECRETS = (USERINFO_SECRET, QUERY_SECRET, SSL_SECRET, KEY_SECRET, S3_SECRET)
STORE_VARIABLES = ("CKPTSTORE_URL", "CKPTSTORE_TOKEN", "CKPTSTORE_HOME", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS")


def with_secrets(url: str) -> str:
    """``url`` with a password in its user-info and two more in its query (ignored by trust auth)."""
    plain = make_url(url).set(password=USERINFO_SECRET).render_as_string(hide_password=False)
    return f"{plain}?password={QUERY_SECRET}&sslpassword={SSL_SECRET}&application_name=ckptstore-test"


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, text


def invoke(*args: str) -> Result:
    """Run ``ckptstore`` in-process with the current environment; never a traceback."""
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert_no_secret(result.stdout, result.stderr)
    return result


@pytest.fixture
def secret_url(postgres_databases: PostgresDatabases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh PostgreSQL database named by a URL full of passwords, set as the environment names it."""
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    url = with_secrets(postgres_databases.create())
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", url)
    monkeypatch.setenv("CKPTSTORE_BLOBS", (tmp_path / "blobs").as_uri())
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path / "home"))
    yield url


def test_db_upgrade_and_verify_show_the_database_with_its_secrets_masked(secret_url: str) -> None:
    upgraded = invoke("db", "upgrade")
    assert upgraded.exit_code == 0, upgraded.output
    assert "password=***&sslpassword=***&application_name=ckptstore-test" in upgraded.stdout
    assert "postgresql+psycopg://postgres:***@" in upgraded.stdout
    assert "upgraded from an empty database" in upgraded.stdout
    again = invoke("db", "upgrade")
    assert "already at revision" in again.stdout

    verified = invoke("verify")
    assert verified.exit_code == 0, verified.output
    assert "store: postgresql+psycopg://postgres:***@" in verified.stdout and "password=***" in verified.stdout
    report = json.loads(invoke("verify", "--json").stdout)
    assert report["ok"] and "sslpassword=***" in report["store"]
    assert invoke("db", "current").exit_code == 0


def test_a_database_error_names_no_secret(secret_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver refuses an unknown option; the error is shown, the URL's secrets are not."""
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", f"{secret_url}&api_key={KEY_SECRET}")
    for args in (("db", "upgrade"), ("verify",), ("ls",)):
        result = invoke(*args)
        assert result.exit_code == 1 and result.stderr.startswith("error: "), (args, result.output)


def test_an_s3_endpoint_url_with_credentials_is_masked_in_errors(
    secret_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore quotes the endpoint URL it could not reach, user-info and all."""
    assert invoke("db", "upgrade").exit_code == 0
    monkeypatch.setenv("CKPTSTORE_BLOBS", "s3://bucket/prefix")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://minio:{S3_SECRET}@127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "minio")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "minio123")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    result = invoke("gc", "--grace", "0")
    assert result.exit_code == 1 and "http://minio:***@127.0.0.1:1" in result.stderr, result.output


def test_a_blob_store_url_that_is_refused_is_quoted_masked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CKPTSTORE_BLOBS", f"ftp://me:{S3_SECRET}@files.example/ckpt")
    result = invoke("serve")
    assert result.exit_code == 2 and "ftp://me:***@files.example/ckpt" in result.stderr, result.output


def test_serve_shows_and_logs_no_secret(postgres_databases: PostgresDatabases, tmp_path: Path) -> None:
    """The real command in a process of its own: its start line, uvicorn's and its log."""
    url = with_secrets(postgres_databases.create())
    database = Database(url)
    try:
        schema.upgrade(database)
    finally:
        database.dispose()
    with serve_process(tmp_path / "home", database_url=url) as served:
        import httpx

        assert httpx.get(f"{served.url}/healthz", timeout=30).status_code == 200
        assert httpx.get(f"{served.url}/v1/runs?password={QUERY_SECRET}", timeout=30).status_code < 500
    log = served.log.read_text(errors="replace")
    assert_no_secret(log)
    assert "ckptstore serving postgresql+psycopg://postgres:***@" in log, log
    assert "password=***&sslpassword=***" in log, log


@pytest.mark.parametrize(
    "url",
    [
        "garbage",
        f"postgresql+psycopg://u:{USERINFO_SECRET}@host:port/db?password={QUERY_SECRET}",
        f"nosuchdialect://u:{USERINFO_SECRET}@host/db?api_key={KEY_SECRET}",
    ],
)
@pytest.mark.parametrize("command", [("db", "upgrade"), ("verify",)])
def test_a_malformed_database_url_is_one_error_line_without_its_secrets(
    url: str, command: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path))
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", url)
    result = invoke(*command)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: database URL") and "is not one ckptstore can open" in lines[0]
    assert_no_secret(result.stdout, result.stderr)
