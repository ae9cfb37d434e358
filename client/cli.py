"""The ``ckptstore`` command line (works on ``CKPTSTORE_URL`` or the embedded ``CKPTSTORE_HOME``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from service.records import RunInfo, VersionInfo

app = typer.Typer(
    help="ckptstore: a checkpoint store for PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Save, load and inspect PyTorch checkpoints."""


@app.command()
def quickstart() -> None:
    """Save and load a small adapter model on the embedded store, printing the dedup saving."""
    from client.quickstart import run

    run()


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _print_runs(runs: list[RunInfo]) -> None:
    typer.echo(f"{'RUN':<32} {'VERSIONS':>8} {'LATEST':>6} {'LOGICAL':>11} {'STORED':>11}  UPDATED")
    for run in runs:
        typer.echo(
            f"{run.run_id:<32} {run.versions:>8} {run.latest_version or '-':>6} "
            f"{_size(run.bytes_total):>11} {_size(run.bytes_new):>11}  {run.updated_at:%Y-%m-%d %H:%M}"
        )


def _print_versions(versions: list[VersionInfo]) -> None:
    typer.echo(f"{'VERSION':>7} {'STEP':>8} {'LOGICAL':>11} {'NEW':>11} {'DEDUP':>6}  {'CREATED':<16}  TAGS")
    for version in versions:
        step = "-" if version.step is None else str(version.step)
        typer.echo(
            f"{version.version:>7} {step:>8} {_size(version.bytes_total):>11} {_size(version.bytes_new):>11} "
            f"{version.dedup_ratio:>6.1%}  {version.created_at:%Y-%m-%d %H:%M}  {','.join(version.tags)}"
        )


@app.command("ls")
def list_(
    run_id: Annotated[str | None, typer.Argument(help="A run: list its versions instead of the runs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """List runs, or the versions of RUN_ID."""
    from client import CheckpointError, default_client

    try:
        if run_id is None:
            runs = default_client().runs()
            rows = [r.model_dump(mode="json") for r in runs]
        else:
            versions = default_client().versions(run_id)
            rows = [v.model_dump(mode="json") for v in versions]
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    elif run_id is None:
        _print_runs(runs)
    else:
        _print_versions(versions)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind [env CKPTSTORE_HOST; default 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port [env CKPTSTORE_PORT; default 8000].")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes [env CKPTSTORE_WORKERS; default 1].")] = None,
) -> None:
    """Run the HTTP service (API, pages) on the configured store with uvicorn."""
    import os

    import uvicorn

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
    if settings.workers == 1:
        uvicorn.run(application, host=settings.host, port=settings.port, log_level="info")
    else:
        uvicorn.run(
            "service.api.server:app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level="info",
        )


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
