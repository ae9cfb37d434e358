"""The command line against real stores: embedded (``CKPTSTORE_HOME``) and, through the client
suite's ``backend`` fixture, a uvicorn server on SQLite and on PostgreSQL + S3 (``CKPTSTORE_URL``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.store import Store
from tests.client.conftest import Backend, backend, ckpt  # noqa: F401  (fixtures used by the CLI tests)


@dataclass
class Cli:
    """Runs ``ckptstore`` in-process against one store; ``client`` saves into the same store."""

    env: dict[str, str | None]
    client: client.Client
    backend: Backend | None = None

    def __call__(self, *args: str, input: str | None = None) -> Result:
        """Run a command; an expected failure must exit cleanly, never with a traceback."""
        result = CliRunner().invoke(app, [str(a) for a in args], env=self.env, input=input)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        return result

    def ok(self, *args: str, input: str | None = None) -> str:
        """Run a command that must succeed; its stdout."""
        result = self(*args, input=input)
        assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
        return result.stdout


def env_for(transport: object, scratch: Path) -> dict[str, str | None]:
    """The environment that points ``ckptstore`` at the store behind ``transport``."""
    if isinstance(transport, HttpTransport):
        return {"CKPTSTORE_URL": transport.url, "CKPTSTORE_HOME": str(scratch), "CKPTSTORE_TOKEN": None}
    assert isinstance(transport, Store)
    return {"CKPTSTORE_URL": None, "CKPTSTORE_HOME": str(transport.staging_dir.parent), "CKPTSTORE_TOKEN": None}


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """The CLI on a fresh embedded store in ``CKPTSTORE_HOME`` (``CKPTSTORE_URL`` unset)."""
    home = tmp_path / "home"
    with client.Client(home=home) as store:
        yield Cli({"CKPTSTORE_URL": None, "CKPTSTORE_HOME": str(home), "CKPTSTORE_TOKEN": None}, store)


@pytest.fixture
def any_cli(backend: Backend, tmp_path: Path) -> Cli:  # noqa: F811
    """The CLI on each backend: embedded, HTTP on SQLite, HTTP on PostgreSQL + S3."""
    return Cli(env_for(backend.client.transport, tmp_path / "unused-home"), backend.client, backend)
