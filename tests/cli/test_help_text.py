"""Every command's ``--help`` names values plainly, as git, hf and mlflow do: ``--dry-run`` alone,
``--keys PATTERN``, ``ls [RUN]``, never typer's type placeholders (``<bool>``, ``<list[str]>``,
``<int range>``) or its braces around required arguments."""

from __future__ import annotations

import re
from collections.abc import Iterator

import click
from typer.main import get_command
from typer.testing import CliRunner

from ckptstore.client.cli import app

#: Wide enough that no option's line wraps, so each line is checked whole.
ENV = {"COLUMNS": "240", "TERM": "dumb", "NO_COLOR": "1"}


def commands(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of ``command`` and of every command under it."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def help_of(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env=ENV)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_no_help_shows_a_type_placeholder_or_braces() -> None:
    every = list(commands(get_command(app)))
    assert ("gc",) in every and ("db", "upgrade") in every and ("import",) in every and len(every) > 15
    for path in every:
        text = help_of(*path)
        placeholders = re.findall(r"<[a-z][a-z_\[\], |]*>", text)
        assert placeholders == [], (path, placeholders)
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "{" not in usage, (path, usage)


def test_flags_stand_alone_and_values_have_plain_names() -> None:
    gc = help_of("gc")
    assert re.search(r"--dry-run\s+Only report", gc) and re.search(r"--grace\s+DURATION", gc)
    assert re.search(r"-h\s+Show this message", gc)
    export = help_of("export")
    assert re.search(r"--keys\s+PATTERN", export) and re.search(r"--format\s+FORMAT", export)
    assert "export [OPTIONS] RUN[@REF] DIR" in export
    assert "ls [OPTIONS] [RUN]" in help_of("ls")
    assert re.search(r"--tag\s+TAG", help_of("import"))
    assert re.search(r"--keep-last\s+N", help_of("retention"))
    assert re.search(r"--port\s+PORT", help_of("serve"))
