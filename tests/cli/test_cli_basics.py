"""What every ``ckptstore`` invocation shares: ``--version``, ``-h`` beside ``--help``, giving up
within seconds on a server it cannot reach, and what the ``client`` extra installs for the
commands' documented use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from ckptstore.client.cli import app
from ckptstore.client.cli.common import ANSWER_SECONDS, REACH_SECONDS, open_client
from ckptstore.client.http.retry import DEFAULT_RETRY_SECONDS, FIRST_REACH_SECONDS
from ckptstore.client.http.transport import HttpTransport

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Hunter2InTheServerUrl"


def invoke(*args: str) -> Result:
    """Run ``ckptstore`` in-process; never a traceback."""
    result = CliRunner().invoke(app, list(args), prog_name="ckptstore")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def every_command() -> list[list[str]]:
    """The argument prefix naming each command and group, nested groups included (``[]`` is the app)."""
    found: list[list[str]] = []

    def walk(command: object, prefix: list[str]) -> None:
        found.append(prefix)
        for name, sub in getattr(command, "commands", {}).items():  # a group (typer bundles its own click)
            walk(sub, [*prefix, name])

    walk(typer.main.get_command(app), [])
    return found


def pyproject() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)


def test_version_prints_the_installed_distributions_version() -> None:
    name = pyproject()["project"]["name"]  # type: ignore[index]
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"ckptstore {version(name)}\n"
    assert result.stderr == ""


def test_dash_h_is_help_on_the_app_and_on_every_command() -> None:
    commands = every_command()
    assert ["ls"] in commands and ["export"] in commands and ["db", "upgrade"] in commands
    for prefix in commands:
        short, long = invoke(*prefix, "-h"), invoke(*prefix, "--help")
        assert short.exit_code == 0, (prefix, short.output)
        assert short.stdout == long.stdout, prefix
        assert "Usage: ckptstore" in short.stdout, prefix


def test_the_client_extra_installs_safetensors_which_the_docs_read_exports_with() -> None:
    extras = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    assert any(requirement.replace(" ", "").startswith("safetensors>=") for requirement in extras["client"])
    assert "safetensors.torch" in (ROOT / "docs" / "import-export.md").read_text(encoding="utf-8")


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that takes connections (the kernel's backlog) but never answers a byte."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def run_against(port: int, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``ckptstore *args`` as its own process on ``CKPTSTORE_URL`` = that port (with a password in
    it), the retry budget left to its defaults; what it did and how many seconds it took."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env["CKPTSTORE_URL"] = f"http://admin:{SECRET}@127.0.0.1:{port}"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=DEFAULT_RETRY_SECONDS,  # the wait this replaces: a hang fails here
    )
    return done, time.monotonic() - started


def assert_one_line_cannot_reach(done: subprocess.CompletedProcess[str], port: int) -> None:
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: cannot reach the ckptstore server at http://admin:***@127.0.0.1:{port}")
    assert SECRET not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # a subprocess that retries a refused connection for its few seconds
def test_a_refused_server_url_is_one_error_line_within_seconds(closed_port: int) -> None:
    done, seconds = run_against(closed_port, "ls")
    assert_one_line_cannot_reach(done, closed_port)
    assert "Connection refused" in done.stderr and "CKPTSTORE_RETRY_SECONDS" in done.stderr
    assert REACH_SECONDS <= seconds < REACH_SECONDS + 10


@pytest.mark.slow  # subprocesses that each wait out the answer timeout
@pytest.mark.parametrize("command", [("ls",), ("gc", "--dry-run")])
def test_a_server_that_never_answers_is_one_error_line_well_before_a_minute(
    silent_port: int, command: tuple[str, ...]
) -> None:
    # `ls` is a metadata call; gc is one the server may rightly take long over, asked only
    # once the server has answered a quick call.
    done, seconds = run_against(silent_port, *command)
    assert_one_line_cannot_reach(done, silent_port)
    assert "sent no answer in time" in done.stderr
    assert ANSWER_SECONDS <= seconds < ANSWER_SECONDS + 10


def test_only_the_command_line_gives_up_early(closed_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A training job's client keeps the patient defaults once its server has answered (a
    # server never reached is tried for FIRST_REACH_SECONDS) and waits long for answers; the
    # CLI's limits apply until the server first answers, the whole budget after (both lazy:
    # nothing is sent here).
    library = HttpTransport(f"http://127.0.0.1:{closed_port}")
    assert library.retry_seconds == DEFAULT_RETRY_SECONDS
    assert library.session._reaching.seconds == FIRST_REACH_SECONDS  # type: ignore[union-attr]
    assert library.session._metadata_timeout.read > ANSWER_SECONDS
    monkeypatch.setenv("CKPTSTORE_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.delenv("CKPTSTORE_RETRY_SECONDS", raising=False)
    with open_client() as ckpt:
        session = ckpt.transport.session  # type: ignore[attr-defined]
        assert session._reaching.seconds == REACH_SECONDS and session.policy.seconds == DEFAULT_RETRY_SECONDS
        assert session._metadata_timeout.read == ANSWER_SECONDS
        assert session._http.timeout.read == library.session._http.timeout.read  # transfers keep theirs
    monkeypatch.setenv("CKPTSTORE_RETRY_SECONDS", "90")  # set: it says how long to keep trying
    with open_client() as ckpt:
        assert ckpt.transport.session._reaching is None  # type: ignore[attr-defined]
    library.close()
