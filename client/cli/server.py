"""``ckptstore serve`` and ``ckptstore db``: the server's own commands.

Torch-free, like every module of this package at import: the server image has no torch and
runs these two. Each imports the engine and the HTTP service only when it runs.
"""

from __future__ import annotations

import errno
from typing import Annotated

import typer

from ckptstore.client.cli.common import echo, error_line
from ckptstore.service.secrets_mask import mask_url


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

    from ckptstore.service.api.app import check_auth_setup
    from ckptstore.service.auth import TokenSet
    from ckptstore.service.errors import CheckpointError
    from ckptstore.service.settings import Settings

    for name, value in (("HOST", host), ("PORT", port), ("WORKERS", workers)):
        if value is not None:
            os.environ[f"CKPTSTORE_{name}"] = str(value)
    try:
        settings = Settings()
        check_auth_setup(TokenSet.parse(settings.tokens), settings.host)
        if settings.workers == 1:
            from ckptstore.service.api.server import app_from_env

            application = app_from_env()
    except CheckpointError as exc:
        echo(error_line(str(exc)), err=True)
        raise typer.Exit(2) from exc
    from ckptstore.service.api.server import listening_socket, run, server_config

    address = _address(settings.host, settings.port)
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as exc:
        in_use = exc.errno == errno.EADDRINUSE
        why = "the address is in use (another process listens there: stop it, or choose another --port)"
        echo(error_line(f"cannot serve on {address}: {why if in_use else exc.strerror or exc}"), err=True)
        raise typer.Exit(1) from exc
    # Said once the server has started on the bound socket (the port bound, should the settings
    # ask for any free one), never before a bind that may fail.
    address = _address(settings.host, sock.getsockname()[1])
    line = f"ckptstore serving {mask_url(settings.resolved_database_url)} on {address}"
    config = server_config(
        application if settings.workers == 1 else "ckptstore.service.api.server:app_from_env", settings
    )
    run(config, sock, announce=lambda: echo(line))


def _address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


db_app = typer.Typer(help="Manage the metadata database schema.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Migrate the configured database (CKPTSTORE_DATABASE_URL, else the embedded one) to the latest schema."""
    from ckptstore.service.db import Database
    from ckptstore.service.db.schema import current_revision, head_revision, upgrade
    from ckptstore.service.errors import CheckpointError
    from ckptstore.service.settings import Settings

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
        echo(error_line(str(exc)), err=True)
        raise typer.Exit(1) from exc
    where = mask_url(url)
    if before == after:
        echo(f"{where}: already at revision {after} (head {head_revision()})")
    else:
        echo(f"{where}: upgraded from {before or 'an empty database'} to {after}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's schema revision and the newest one this ckptstore knows."""
    from ckptstore.service.db import Database
    from ckptstore.service.db.schema import current_revision, head_revision
    from ckptstore.service.errors import CheckpointError
    from ckptstore.service.settings import Settings

    try:
        database = Database(Settings().resolved_database_url)
        current = current_revision(database)
        database.dispose()
    except CheckpointError as exc:
        echo(error_line(str(exc)), err=True)
        raise typer.Exit(1) from exc
    echo(f"current: {current or 'none'}  head: {head_revision()}")
