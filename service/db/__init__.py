"""Metadata database: SQLAlchemy models and sessions (SQLite embedded, PostgreSQL served)."""

from service.db.session import Database

__all__ = ["Database"]
