"""Settings resolve to usable locations; secrets never reach the access log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckptstore.service.api.redact import RedactTokens, redact
from ckptstore.service.settings import Settings


def test_a_relative_home_resolves_to_absolute_locations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings(home=Path(".ckptstore"))
    assert settings.resolved_blobs == (tmp_path / ".ckptstore" / "blobs").as_uri()
    assert settings.resolved_database_url == f"sqlite:///{tmp_path / '.ckptstore' / 'metadata.db'}"
    assert settings.staging_dir.is_absolute()


def test_environment_variables_configure_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("CKPTSTORE_BLOBS", "s3://bucket/prefix")
    monkeypatch.setenv("CKPTSTORE_WORKERS", "4")
    settings = Settings()
    assert settings.resolved_database_url == "postgresql+psycopg://u@h/db"
    assert settings.resolved_blobs == "s3://bucket/prefix"
    assert settings.workers == 4


def test_query_string_tokens_are_masked_in_logs() -> None:
    assert redact("GET /v1/runs?token=abc123&x=1") == "GET /v1/runs?token=***&x=1"
    assert redact("/v1/runs?Access_Token=s3cret") == "/v1/runs?Access_Token=***"
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s "%s"', ("1.2.3.4", "/v1/runs?key=zzz"), None)
    RedactTokens().filter(record)
    assert "zzz" not in record.getMessage()
