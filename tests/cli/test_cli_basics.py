"""What every ``ckptstore`` invocation shares: ``--version``, ``-h`` beside ``--help``, and what the
``client`` extra installs for the commands' documented use."""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import typer
from typer.testing import CliRunner, Result

from client.cli import app

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_client_extra_installs_safetensors_which_the_readme_reads_exports_with() -> None:
    extras = pyproject()["project"]["optional-dependencies"]  # type: ignore[index]
    assert any(requirement.replace(" ", "").startswith("safetensors>=") for requirement in extras["client"])
    assert "safetensors.torch" in (ROOT / "README.md").read_text(encoding="utf-8")
