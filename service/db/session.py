"""Database engines and transactions for SQLite (embedded) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import Base
from service.errors import CheckpointError, StorageError


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE: the write lock is taken at the
        # start, so two writers queue on busy_timeout instead of failing to upgrade a read lock.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """An engine plus a session factory; :meth:`transaction` is the unit of work."""

    def __init__(self, url: str, *, create_schema: bool = False, **engine_options: Any) -> None:
        self.url = url
        self.engine = create_engine(url, **engine_options)
        if self.engine.dialect.name == "sqlite":
            _configure_sqlite(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if create_schema:
            Base.metadata.create_all(self.engine)

    @classmethod
    def sqlite_file(cls, path: Path) -> Database:
        """An embedded database in one SQLite file, its schema created if new."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{path}", create_schema=True)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work commits on success and rolls back on any error.

        Database failures surface as StorageError; ckptstore's own errors pass unchanged.
        """
        session = self._sessions()
        try:
            yield session
            session.commit()
        except CheckpointError:
            session.rollback()
            raise
        except SQLAlchemyError as exc:
            session.rollback()
            raise StorageError(f"metadata database error: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
