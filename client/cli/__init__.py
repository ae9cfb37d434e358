"""The ``ckptstore`` command line (works on ``CKPTSTORE_URL`` or the embedded ``CKPTSTORE_HOME``).

One module per command group: :mod:`~client.cli.inspect` (ls, show, diff),
:mod:`~client.cli.manage` (tag, untag, rm, gc), :mod:`~client.cli.retention`,
:mod:`~client.cli.transfer` (export, import, verify) and :mod:`~client.cli.server` (serve, db),
with what they share in :mod:`~client.cli.common`. No module imports torch, numpy or
:mod:`client.api` at import: the commands that handle tensors import them when they run, so
``ckptstore serve`` and ``ckptstore db`` work in the torch-free server image.

May import every package of ``client`` and ``service``; torch only inside the commands that
save or load tensors, so listing and serving commands start without it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptstore.client.cli import inspect, manage, retention, transfer
from ckptstore.client.cli.common import echo
from ckptstore.client.cli.help_names import PlainHelpGroup
from ckptstore.client.cli.server import db_app, serve

#: The distribution ``pyproject.toml`` names: ``--version`` prints its installed version.
DISTRIBUTION = "ckptstore"

app = typer.Typer(
    cls=PlainHelpGroup,  # --help names values plainly (--keys PATTERN), never <list[str]>
    help="ckptstore: a checkpoint store for PyTorch training.",
    no_args_is_help=True,
    # Inherited by every command's context: ``ckptstore ls -h`` as well as ``ckptstore -h``.
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)


def installed_version() -> str:
    """The installed version of the ``ckptstore`` distribution (``unknown`` when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    """``--version``: print the installed version and exit 0 before any command runs."""
    if value:
        echo(f"ckptstore {installed_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the installed version and exit."),
    ] = False,
) -> None:
    """Save, load and inspect PyTorch checkpoints."""


@app.command()
def quickstart() -> None:
    """Save and load a small adapter model on the embedded store, printing the dedup saving."""
    from ckptstore.client.cli.quickstart import run

    run()


app.command("ls")(inspect.list_)
app.command()(inspect.show)
app.command()(inspect.diff)
app.command()(manage.tag)
app.command()(manage.untag)
app.command()(manage.rm)
app.command()(retention.retention)
app.command()(transfer.export)
app.command("import")(transfer.import_)
app.command()(transfer.verify)
app.command()(manage.gc)
app.command()(serve)
app.add_typer(db_app, name="db")

__all__ = ["app", "db_app", "serve"]
