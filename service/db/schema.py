"""The metadata schema's revision: Alembic run in code, with no ``alembic.ini`` for users to keep.

The migration scripts are installed as the package ``ckptstore.service.migrations`` (the repository's
top-level ``migrations/`` folder). Embedded SQLite stores upgrade themselves when opened; a served
PostgreSQL database is upgraded by its operator with ``ckptstore db upgrade``, and the service
refuses to start on any other revision (:func:`require_current`).

To write a new migration against a scratch database at head::

    from alembic import command
    from ckptstore.service.db import Database, schema
    with Database(url).engine.begin() as connection:
        command.revision(schema.alembic_config(connection), "what changed", autogenerate=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ckptstore.service.errors import StorageError
from ckptstore.service.schema_revisions import head_revision, migrations_dir, revisions

if TYPE_CHECKING:
    from alembic.config import Config

UPGRADE_COMMAND = "ckptstore db upgrade"
FIRST_REVISION = "0001"


class Migratable(Protocol):
    """A database as this module sees it: an engine to connect with.

    :class:`service.db.session.Database` is one; asking for no more lets it migrate itself on
    opening while this module never imports it.
    """

    @property
    def engine(self) -> Engine: ...


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config built in code; ``connection``, if given, is the one migrated."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def current_revision(database: Migratable) -> str | None:
    """The revision ``database`` is at, or None for a database never migrated (e.g. empty)."""
    try:
        with database.engine.connect() as connection:
            if not inspect(connection).has_table("alembic_version"):
                return None
            row = connection.execute(text("SELECT version_num FROM alembic_version")).first()
            return None if row is None else str(row[0])
    except SQLAlchemyError as exc:
        raise StorageError(f"could not read the metadata database's schema revision: {_first_line(exc)}") from exc


def upgrade(database: Migratable) -> None:
    """Migrate ``database`` to the newest revision; a database already there is left alone.

    The whole upgrade is one transaction, so a failure leaves the old schema. On SQLite that
    transaction begins with ``BEGIN IMMEDIATE``: processes opening a fresh store at once queue
    on the write lock, and each later one finds the schema current.
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.util import CommandError

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


def require_current(database: Migratable) -> None:
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
    return revision in revisions()


def _newer_than_us(current: str) -> StorageError:
    return StorageError(
        f"the database schema is at revision {current}, which this ckptstore does not know "
        f"(its newest is {head_revision()}): a newer ckptstore migrated it; upgrade ckptstore"
    )


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


__all__ = [
    "alembic_config",
    "current_revision",
    "Migratable",
    "head_revision",
    "migrations_dir",
    "require_current",
    "revisions",
    "upgrade",
]
