"""The metadata schema's revision: Alembic run in code, with no ``alembic.ini`` for users to keep.

The migration scripts are installed as the package ``service.migrations`` (the repository's
top-level ``migrations/`` folder). Embedded SQLite stores upgrade themselves when opened; a served
PostgreSQL database is upgraded by its operator with ``ckptstore db upgrade``, and the service
refuses to start on any other revision (:func:`require_current`).

To write a new migration against a scratch database at head::

    from alembic import command
    from service.db import Database, schema
    with Database(url).engine.begin() as connection:
        command.revision(schema.alembic_config(connection), "what changed", autogenerate=True)
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

import service.migrations
from service.errors import StorageError

if TYPE_CHECKING:
    from service.db.session import Database

UPGRADE_COMMAND = "ckptstore db upgrade"
FIRST_REVISION = "0001"


def migrations_dir() -> Path:
    """The folder holding ``env.py`` and ``versions/``, wherever the package is installed."""
    return Path(service.migrations.__file__).parent


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config built in code; ``connection``, if given, is the one migrated."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@lru_cache(maxsize=1)
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this ckptstore's migrations know."""
    head = _scripts().get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001
        raise StorageError(f"no migrations found in {migrations_dir()}; the ckptstore installation is incomplete")
    return head


def current_revision(database: Database) -> str | None:
    """The revision ``database`` is at, or None for a database never migrated (e.g. empty)."""
    try:
        with database.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as exc:
        raise StorageError(f"could not read the metadata database's schema revision: {_first_line(exc)}") from exc


def upgrade(database: Database) -> None:
    """Migrate ``database`` to the newest revision; a database already there is left alone.

    The whole upgrade is one transaction, so a failure leaves the old schema. On SQLite that
    transaction begins with ``BEGIN IMMEDIATE``: processes opening a fresh store at once queue
    on the write lock, and each later one finds the schema current.
    """
    try:
        with database.engine.begin() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
            if current is not None and not _known(current):
                raise _newer_than_us(current)
            config = alembic_config(connection)
            if current is None and inspect(connection).has_table("runs"):
                # A store created before migrations existed has exactly revision 0001's tables.
                command.stamp(config, FIRST_REVISION)
            command.upgrade(config, "head")
    except SQLAlchemyError as exc:
        raise StorageError(f"could not upgrade the metadata database schema: {_first_line(exc)}") from exc
    except CommandError as exc:
        raise StorageError(f"could not upgrade the metadata database schema: {exc}") from exc


def require_current(database: Database) -> None:
    """Raise StorageError, naming the fix, unless ``database`` is at the newest revision."""
    current, head = current_revision(database), head_revision()
    if current == head:
        return
    if current is not None and not _known(current):
        raise _newer_than_us(current)
    shown = current if current is not None else "none (an empty database)"
    raise StorageError(
        f"the database schema is at revision {shown} but this ckptstore needs {head}: run `{UPGRADE_COMMAND}`"
    )


def _known(revision: str) -> bool:
    try:
        return _scripts().get_revision(revision) is not None
    except CommandError:
        return False


def _newer_than_us(current: str) -> StorageError:
    return StorageError(
        f"the database schema is at revision {current}, which this ckptstore does not know "
        f"(its newest is {head_revision()}): a newer ckptstore migrated it; upgrade ckptstore"
    )


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


__all__ = ["alembic_config", "current_revision", "head_revision", "migrations_dir", "require_current", "upgrade"]
