"""Alembic environment: migrate the connection handed over in code, or the configured database.

:mod:`service.db.schema` passes an open connection as ``config.attributes["connection"]`` (its
transaction is the migration's, so SQLite's ``BEGIN IMMEDIATE`` serializes concurrent upgraders).
Without one, the URL is the config's ``sqlalchemy.url`` if set, else the store's settings
(``CKPTSTORE_DATABASE_URL``, default SQLite under ``CKPTSTORE_HOME``). No URL is written here.
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from ckptstore.service.db.models import Base, UTCDateTime
from ckptstore.service.settings import Settings

config = context.config
target_metadata = Base.metadata


def render_item(kind: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Write our UTCDateTime as the plain type it stores, so scripts never import the models."""
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def configure(**options: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_item=render_item,
        compare_type=True,
        **options,
    )


def run_on(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
    configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url


given = config.attributes.get("connection")
if context.is_offline_mode():
    url = database_url()
    configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()
elif given is not None:
    run_on(given)
else:
    engine = create_engine(database_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            run_on(connection)
    finally:
        engine.dispose()
