"""The ``ckptstore`` command line (works on ``CKPTSTORE_URL`` or the embedded ``CKPTSTORE_HOME``)."""

from __future__ import annotations

from typing import Annotated, cast

import typer

from client import cli_inspect, cli_manage, cli_retention, cli_transfer
from client.cli_common import echo_json, open_client, reported, size, table
from service.format.names import validate_run_id
from service.records import RunInfo, VersionInfo

app = typer.Typer(
    help="ckptstore: a checkpoint store for PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)


@app.callback()
def main() -> None:
    """Save, load and inspect PyTorch checkpoints."""


@app.command()
def quickstart() -> None:
    """Save and load a small adapter model on the embedded store, printing the dedup saving."""
    from client.quickstart import run

    run()


def _print_runs(runs: list[RunInfo]) -> None:
    rows = [
        (
            run.run_id,
            run.versions,
            run.latest_version,
            size(run.bytes_total),
            size(run.bytes_new),
            f"{run.updated_at:%Y-%m-%d %H:%M}",
        )
        for run in runs
    ]
    table(("RUN", "VERSIONS", "LATEST", "LOGICAL", "STORED", "UPDATED"), rows, right=(1, 2, 3, 4))


def _print_versions(versions: list[VersionInfo]) -> None:
    rows = [
        (
            v.version,
            v.step,
            size(v.bytes_total),
            size(v.bytes_new),
            f"{v.dedup_ratio:.1%}",
            f"{v.created_at:%Y-%m-%d %H:%M}",
            ",".join(v.tags),
        )
        for v in versions
    ]
    table(("VERSION", "STEP", "LOGICAL", "NEW", "DEDUP", "CREATED", "TAGS"), rows, right=(0, 1, 2, 3, 4))


@app.command("ls")
def list_(
    run_id: Annotated[str | None, typer.Argument(metavar="RUN", help="A run: list its versions instead.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """List runs, or the versions of RUN.

    --json prints a list of objects: for runs run_id, created_at, updated_at, versions,
    latest_version, bytes_total, bytes_new; for versions run_id, version, parent, created_at,
    tags, step, metrics, tensors_total, tensors_new, bytes_total, bytes_new, bytes_trainable.
    """
    with reported():
        if run_id is not None:
            validate_run_id(run_id)
        with open_client() as ckpt:
            records: list[RunInfo] | list[VersionInfo] = ckpt.runs() if run_id is None else ckpt.versions(run_id)
    if as_json:
        echo_json([r.model_dump(mode="json") for r in records])
    elif run_id is None:
        _print_runs(cast(list[RunInfo], records))
    else:
        _print_versions(cast(list[VersionInfo], records))


# The commands that read and write checkpoints live in their own modules (each imports torch
# only when it runs, so `ckptstore serve` and `ckptstore db` work in the torch-free image).
app.command()(cli_inspect.show)
app.command()(cli_inspect.diff)
app.command()(cli_manage.tag)
app.command()(cli_manage.untag)
app.command()(cli_manage.rm)
app.command()(cli_retention.retention)
app.command()(cli_transfer.export)
app.command("import")(cli_transfer.import_)
app.command()(cli_transfer.verify)
app.command()(cli_manage.gc)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind [env CKPTSTORE_HOST; default 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [env CKPTSTORE_PORT; default 8000].")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes [env CKPTSTORE_WORKERS; default 1].")] = None,
) -> None:
    """Run the HTTP service (API, pages) on the configured store with uvicorn.

    Body limits, read timeouts and the connection cap come from the settings (README, "Limits
    and timeouts"); the access log records paths, never a query string's values.
    """
    import os

    from service.api.app import check_auth_setup
    from service.auth import TokenSet
    from service.errors import CheckpointError
    from service.settings import Settings

    for name, value in (("HOST", host), ("PORT", port), ("WORKERS", workers)):
        if value is not None:
            os.environ[f"CKPTSTORE_{name}"] = str(value)
    try:
        settings = Settings()
        check_auth_setup(TokenSet.parse(settings.tokens), settings.host)
        if settings.workers == 1:
            from service.api.server import app_from_env

            application = app_from_env()
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"ckptstore serving {settings.resolved_database_url.split('@')[-1]} on http://{settings.host}:{settings.port}"
    )
    from service.api.server import run, server_config

    run(server_config(application if settings.workers == 1 else "service.api.server:app_from_env", settings))


db_app = typer.Typer(help="Manage the metadata database schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Migrate the configured database (CKPTSTORE_DATABASE_URL, else the embedded one) to the latest schema."""
    from service.db import Database
    from service.db.schema import current_revision, head_revision, upgrade
    from service.errors import CheckpointError
    from service.settings import Settings

    settings = Settings()
    url = settings.resolved_database_url
    try:
        if settings.database_url is None:
            settings.home_path.mkdir(parents=True, exist_ok=True)
        database = Database(url)
        before = current_revision(database)
        upgrade(database)
        after = current_revision(database)
        database.dispose()
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    where = url.split("@")[-1]
    if before == after:
        typer.echo(f"{where}: already at revision {after} (head {head_revision()})")
    else:
        typer.echo(f"{where}: upgraded from {before or 'an empty database'} to {after}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's schema revision and the newest one this ckptstore knows."""
    from service.db import Database
    from service.db.schema import current_revision, head_revision
    from service.errors import CheckpointError
    from service.settings import Settings

    try:
        database = Database(Settings().resolved_database_url)
        current = current_revision(database)
        database.dispose()
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"current: {current or 'none'}  head: {head_revision()}")


if __name__ == "__main__":
    app()
