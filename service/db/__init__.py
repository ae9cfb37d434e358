"""Metadata database: SQLAlchemy models and sessions (SQLite embedded, PostgreSQL served), schema revisions,
and the reserve of disk space a SQLite database keeps for cleanup (``reserve``).

It may import SQLAlchemy, Alembic and, of the engine, only :mod:`service.errors`,
:mod:`service.secrets_mask` and :mod:`service.schema_revisions`: never the store, its job modules,
``format`` or ``blobs``. Inside, ``session`` imports ``schema`` and not the reverse: the
schema's functions take any object with an engine (:class:`service.db.schema.Migratable`).
"""

from ckptstore.service.db.session import Database

__all__ = ["Database"]
