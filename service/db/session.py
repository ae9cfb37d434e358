"""Database engines and transactions for SQLite (embedded) and PostgreSQL."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from time import monotonic, sleep
from typing import Any, cast

from sqlalchemy import Select, Table, create_engine, event
from sqlalchemy.dialects.sqlite import dialect as sqlite_dialect
from sqlalchemy.engine import Connection, CursorResult, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ckptstore.service.db import schema
from ckptstore.service.db.models import Base, table
from ckptstore.service.db.reserve import sqlite_folder
from ckptstore.service.errors import (
    CheckpointError,
    IntegrityError,
    InvalidInputError,
    StorageError,
    StorageFullError,
    is_disk_full,
)
from ckptstore.service.secrets_mask import mask_url

#: Rows per executemany of an INSERT: bounds the parameter lists built at once.
INSERT_BATCH = 500


@functools.cache
def _insert_or_skip(dialect: str, table: Table) -> Any:
    """``INSERT … ON CONFLICT DO NOTHING`` of one row into ``table``, built once per dialect.

    A single-row statement with bound parameters is compiled once and cached, where a multi-row
    VALUES list has no cache key and was compiled anew on every call (~0.3 ms each).
    """
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table).on_conflict_do_nothing()
    raise StorageError(f"the metadata database must be SQLite or PostgreSQL, not {dialect}")


def _statement_for(session: Session, model: type[Base]) -> Any:
    return _insert_or_skip(session.get_bind().dialect.name, table(model))


def insert_new(session: Session, model: type[Base], row: dict[str, Any]) -> bool:
    """Insert ``row`` if its primary key is free; whether it was inserted.

    ``INSERT … ON CONFLICT DO NOTHING``: when another transaction is inserting the same key,
    PostgreSQL waits for it and then skips the row, so concurrent writers of the same row both
    succeed. Many rows at once go through :func:`insert_missing`, in key order.
    """
    # SQLAlchemy reports an INSERT's row count only when asked to keep it.
    statement = _statement_for(session, model).execution_options(preserve_rowcount=True)
    return cast(CursorResult[Any], session.connection().execute(statement, row)).rowcount > 0


def insert_missing(session: Session, model: type[Base], rows: Sequence[dict[str, Any]]) -> None:
    """:func:`insert_new` for many rows when the count does not matter (see :func:`insert_columns`)."""
    if rows:
        insert_columns(session, model, {key: [row[key] for row in rows] for key in rows[0]})


def insert_columns(session: Session, model: type[Base], columns: dict[str, Sequence[Any]]) -> None:
    """:func:`insert_missing` of rows given column by column: each column's values, in row order.

    One single-row statement run for every row (``executemany``): it is compiled once and
    cached, where a multi-row VALUES list is compiled anew for each size, which for a shard
    of a few hundred small tensors cost more than storing its bytes. It runs on the session's
    connection as a Core statement. A shard's 32,768 tensors, given as columns, skip building a
    dict for each row only to take it apart again.
    """
    keys = tuple(columns)
    count = len(columns[keys[0]]) if keys else 0
    if not count:
        return
    connection = session.connection()
    if connection.dialect.name == "sqlite":
        driver = _sqlite_insert(table(model), keys)
        if driver is not None:
            sql, processors = driver
            processed = [
                values if process is None else _processed(values, process)
                for values, process in zip(columns.values(), processors, strict=True)
            ]
            rows = list(zip(*processed, strict=True))
            for start in range(0, count, INSERT_BATCH):
                connection.exec_driver_sql(sql, rows[start : start + INSERT_BATCH])
            return
    # On the table, not the mapped class: the ORM's bulk path handles every row in Python first.
    statement = _statement_for(session, model)
    for start in range(0, count, INSERT_BATCH):
        batch = (values[start : start + INSERT_BATCH] for values in columns.values())
        connection.execute(statement, [dict(zip(keys, row, strict=True)) for row in zip(*batch, strict=True)])


def driver_rows(connection: Connection, sql: str, parameters: Sequence[Any]) -> Sequence[Any]:
    """Every row of ``sql`` (the driver's own SQL, ``?`` placeholders) run on the connection's
    driver cursor, inside its transaction: plain tuples, without SQLAlchemy wrapping each row
    (about a tenth of locating 32,768 tensors went to building those wrappers)."""
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql, parameters)
        return cursor.fetchall()
    finally:
        cursor.close()


def rows_in(connection: Connection, statement: Select[Any], name: str, values: Sequence[Any]) -> Sequence[Any]:
    """Every row of ``statement`` with ``values`` for its expanding parameter ``name`` (an IN
    list), as plain tuples, its other parameters as the statement binds them.

    In SQLite the driver runs the statement compiled once for each count of values, where
    SQLAlchemy expands the list and compiles it anew at each run (a third of checking a commit's
    32,768 references) and wraps every row.
    """
    expanded = _sqlite_expanded(statement, name, len(values)) if connection.dialect.name == "sqlite" else None
    if expanded is None:
        return connection.execute(statement, {name: list(values)}).all()
    sql, template, slots = expanded
    parameters = list(template)
    for slot, value in zip(slots, values, strict=True):
        parameters[slot] = value
    return driver_rows(connection, sql, parameters)


@functools.cache
def _sqlite_expanded(
    statement: Select[Any], name: str, count: int
) -> tuple[str, tuple[Any, ...], tuple[int, ...]] | None:
    """``statement`` as SQLite's driver runs it with ``count`` values for ``name``: its SQL, every
    placeholder's value (None where one of ``name``'s goes) and the places of ``name``'s. None
    where a parameter's type processes its values in Python (the driver would not)."""
    dialect = sqlite_dialect()
    compiled = statement.compile(dialect=dialect)
    if name not in compiled.binds or not compiled.binds[name].expanding:
        raise ValueError(f"the statement does not expand {name!r} into a list")
    if any(bind.type.dialect_impl(dialect).bind_processor(dialect) for bind in compiled.binds.values()):
        return None
    state = compiled.construct_expanded_state({name: [None] * count})
    expanded = {f"{name}_{number}" for number in range(1, count + 1)}
    order = state.positiontup or []
    slots = tuple(place for place, key in enumerate(order) if key in expanded)
    return state.statement, tuple(state.parameters[key] for key in order), slots


@functools.cache
def _sqlite_insert(table: Table, keys: tuple[str, ...]) -> tuple[str, tuple[Any, ...]] | None:
    """The driver's SQL of :func:`insert_missing` into ``table`` of the ``keys`` columns in SQLite,
    with each column's value processor (None where the driver takes the value as it is).

    Run as driver SQL, a shard of 32,768 tensors was recorded in 0.3 s, against 0.5 s as a Core
    statement, whose executemany processes every row's parameters in Python first. None when a
    column left out has a default computed in Python: that statement fills it in.
    """
    if any(c.default is not None and c.name not in keys for c in table.columns):
        return None
    dialect = sqlite_dialect()
    quote = dialect.identifier_preparer.quote
    columns = ", ".join(quote(key) for key in keys)
    marks = ", ".join("?" for _ in keys)
    sql = f"INSERT INTO {quote(table.name)} ({columns}) VALUES ({marks}) ON CONFLICT DO NOTHING"
    return sql, tuple(table.c[key].type.bind_processor(dialect) for key in keys)


def _processed(values: Sequence[Any], process: Any) -> list[Any]:
    """``process`` of each value, worked out once per distinct value where the values are
    shapes (tuples, or lists told apart by ``repr``) bound for a JSON column: a model's tensors
    share a few."""
    if all(type(value) is tuple for value in values):
        keys: Sequence[Any] = values  # tuples of whole numbers: their own keys
    elif all(type(value) is list for value in values):
        keys = [repr(value) for value in values]
    else:
        return [process(value) for value in values]
    done: dict[Any, Any] = {}
    result = []
    for key, value in zip(keys, values, strict=True):
        text = done.get(key)
        if text is None:
            text = done[key] = process(list(value))
        result.append(text)
    return result


#: How long a SQLite connection waits for another one's lock before giving up.
BUSY_TIMEOUT_SECONDS = 60
#: Most page cache, in KiB, each SQLite connection keeps.
SQLITE_CACHE_KIB = 32 << 10


#: What a metadata file whose bytes no longer make sense is called in errors: ``ckptstore verify``
#: names what changed where the file still opens; a backup or a replica is the way back.
DAMAGED = "the metadata file is damaged (restore it from a backup)"


def _switch_to_wal(cursor: Any) -> None:
    """Put the database in WAL mode (it stays so: later connections find it there).

    SQLite may refuse the switch at once, without waiting out the busy timeout, while another
    connection opening the same fresh file holds a lock (seen with eight stores opened at once:
    "database is locked"). The switch is retried with a growing pause until the timeout.
    """
    if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = monotonic() + BUSY_TIMEOUT_SECONDS
    pause = 0.001
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or monotonic() + pause > deadline:
                raise
        sleep(pause)  # a backoff between attempts, not a wait for a known event
        pause = min(pause * 2, 0.1)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE: the write lock is taken at the
        # start, so two writers queue on busy_timeout instead of failing to upgrade a read lock.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # The timeout first: switching a fresh file to WAL needs a lock other openers may hold.
            cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_SECONDS * 1000}")
            _switch_to_wal(cursor)
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            # SQLite's default page cache (2 MiB) holds a small fraction of the tensor rows of a
            # model of many tensors: locating 32,768 tensors took 1.6x as long with it. Pages are
            # taken as needed, up to this much per connection.
            cursor.execute(f"PRAGMA cache_size={-SQLITE_CACHE_KIB}")
        except UnicodeDecodeError as exc:
            # A damaged schema page: SQLite's error quotes the damaged text, which is not UTF-8.
            # As a driver error, SQLAlchemy reports it as the database's (StorageError here).
            raise sqlite3.DatabaseError(f"{DAMAGED}: its schema holds bytes that are not text") from exc
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _upgrade_if_behind(database: Database) -> None:
    # Reading the revision is cheap; loading the migration scripts is not, so only when needed.
    if schema.current_revision(database) != schema.head_revision():
        schema.upgrade(database)


class Database:
    """An engine plus a session factory; :meth:`transaction` is the unit of work.

    Args:
        url: a SQLAlchemy URL (``sqlite:///…`` or ``postgresql+psycopg://…``).
        create_schema: migrate the database to the newest schema revision now.
        engine_options: passed to :func:`sqlalchemy.create_engine` (e.g. ``pool_size``).
    """

    def __init__(self, url: str, *, create_schema: bool = False, **engine_options: Any) -> None:
        self.url = url
        try:
            parsed = make_url(url)
            parsed.get_dialect()
        except (ArgumentError, ValueError, NoSuchModuleError) as exc:
            raise InvalidInputError(
                f"database URL {mask_url(url)} is not one ckptstore can open ({type(exc).__name__}); write "
                "postgresql+psycopg://user@host:5432/name or sqlite:///path/to/metadata.db"
            ) from None
        if parsed.get_backend_name() == "postgresql":
            # A served database outlives connections: servers restart, proxies drop idle ones.
            engine_options.setdefault("pool_pre_ping", True)
        self.engine = create_engine(url, **engine_options)
        if self.engine.dialect.name == "sqlite":
            _configure_sqlite(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if create_schema:
            self._or_dispose(schema.upgrade)

    def _or_dispose(self, check: Callable[[Database], None]) -> Database:
        try:
            check(self)
        except StorageError as exc:
            self.dispose()
            if is_disk_full(exc) and not isinstance(exc, StorageFullError):
                raise self.full_disk(exc) from exc
            raise
        except BaseException:
            self.dispose()
            raise
        return self

    def full_disk(self, exc: BaseException) -> StorageFullError:
        """The error for a database whose disk is full: its folder (a SQLite file's) or its server."""
        folder = sqlite_folder(self.url)
        where = folder if folder is not None else f"the metadata database at {mask_url(self.url)}"
        driver = getattr(exc, "orig", None) or exc.__cause__ or exc
        return StorageFullError.of_folder(where, str(driver).splitlines()[0] if str(driver) else type(driver).__name__)

    @classmethod
    def open(cls, url: str, **engine_options: Any) -> Database:
        """The database at ``url``, ready for the store.

        A SQLite file is an embedded store's and migrates itself (:meth:`sqlite_file`). Any other
        database belongs to an operator, who runs ``ckptstore db upgrade``: it must already be at
        the newest schema revision, or StorageError says so.
        """
        if make_url(url).get_backend_name() == "sqlite":
            return cls(url, **engine_options)._or_dispose(_upgrade_if_behind)
        return cls(url, **engine_options)._or_dispose(schema.require_current)

    @classmethod
    def sqlite_file(cls, path: Path) -> Database:
        """An embedded database in one SQLite file, migrated to the newest schema if behind.

        Many processes may open a fresh home at once: the upgrade runs under SQLite's write
        lock, so one migrates and the others find the schema current.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{path}")._or_dispose(_upgrade_if_behind)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work commits on success and rolls back on any error.

        Database failures surface as StorageError, stored values that no longer parse (a damaged
        file) as IntegrityError; ckptstore's own errors pass unchanged.
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
            if is_disk_full(exc):  # SQLITE_FULL: not an outage, and the way out is known
                raise self.full_disk(exc) from exc
            raise StorageError(f"metadata database error: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
        except sqlite3.Error as exc:  # from the driver's own cursor (driver_rows), unwrapped
            session.rollback()
            if is_disk_full(exc):
                raise self.full_disk(exc) from exc
            raise StorageError(f"metadata database error: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
        except ValueError as exc:
            # A stored value that no longer parses (JSON, a timestamp, text that is not UTF-8):
            # damaged bytes, never an answer to pass on, and no passing outage to retry.
            session.rollback()
            cause = f"{type(exc).__name__}: {exc}".splitlines()[0]
            message = f"metadata database error: {DAMAGED}: a stored value does not parse ({cause})"
            raise IntegrityError(message) from exc
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
