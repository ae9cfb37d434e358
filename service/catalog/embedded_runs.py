"""The runs and versions of an embedded store, read with the standard library's ``sqlite3``:
``ckptstore ls`` and ``ckptstore ls RUN``.

Listing is what the command line does most, and opening a store through SQLAlchemy costs its
import (about 0.2 s of a half-second command) before a single row is read. An embedded store is
one SQLite file, so the listings read it directly, read-only, with the statements
:meth:`service.store.Store.runs` and :meth:`~service.store.Store.versions` amount to. They do so
only where they know the file: a store at the schema revision this ckptstore's migrations end
at. Anything else (no store yet, another revision, a run that does not exist, a database that is
locked, damaged or not SQLite) answers None, and the caller opens the store the usual way, which
migrates, refuses or explains. Tests hold the two ways to the same answer on stores built
through the engine.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from ckptstore.service.format.records import RunInfo, VersionInfo, tags_by_version
from ckptstore.service.schema_revisions import head_revision

_RUNS = """
SELECT runs.id, runs.created_at, runs.updated_at, count(versions.version), max(versions.version),
       coalesce(sum(versions.bytes_total), 0), coalesce(sum(versions.bytes_new), 0)
FROM runs LEFT JOIN versions ON versions.run_id = runs.id
GROUP BY runs.id
ORDER BY runs.updated_at DESC, runs.id
"""
_RUN_EXISTS = "SELECT 1 FROM runs WHERE id = ?"
_VERSIONS = """
SELECT run_id, version, parent, created_at, step, metrics, tensors_total, tensors_new, bytes_total,
       bytes_new, bytes_trainable
FROM versions WHERE run_id = ? ORDER BY version
"""
_TAGS = "SELECT version, name FROM tags WHERE run_id = ?"

T = TypeVar("T")


def read_runs(database: Path) -> list[RunInfo] | None:
    """Every run of the embedded store whose SQLite file is ``database`` (its
    :attr:`Settings.embedded_database <service.settings.Settings.embedded_database>`), with its
    totals, most recently updated first, as :meth:`Store.runs` returns them; None where this
    reader does not apply (see above)."""
    return _read(database, _runs)


def read_versions(database: Path, run_id: str) -> list[VersionInfo] | None:
    """Every version of ``run_id`` in the embedded store whose SQLite file is ``database``, oldest
    first, as :meth:`Store.versions` returns them; None where this reader does not apply, or the
    run does not exist (the engine then says so)."""
    return _read(database, lambda connection: _versions(connection, run_id))


def _read(database: Path, read: Callable[[sqlite3.Connection], T | None]) -> T | None:
    try:
        with _opened(database) as connection:
            if connection is None:
                return None
            return read(connection)
    except (sqlite3.Error, TypeError, ValueError, KeyError):
        return None  # a file or value this reader does not know how to read: the engine will


@contextmanager
def _opened(path: Path) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection to ``path`` at the newest schema revision, or None."""
    if not path.is_file():
        yield None
        return
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    try:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
        yield connection if row is not None and row[0] == head_revision() else None
    finally:
        connection.close()


def _runs(connection: sqlite3.Connection) -> list[RunInfo]:
    return [
        RunInfo(
            run_id=run_id,
            created_at=_timestamp(created_at),
            updated_at=_timestamp(updated_at),
            versions=count,
            latest_version=latest,
            bytes_total=int(total),
            bytes_new=int(new),
        )
        for run_id, created_at, updated_at, count, latest, total, new in connection.execute(_RUNS)
    ]


def _versions(connection: sqlite3.Connection, run_id: str) -> list[VersionInfo] | None:
    if connection.execute(_RUN_EXISTS, (run_id,)).fetchone() is None:
        return None
    tags = tags_by_version(connection.execute(_TAGS, (run_id,)))
    versions = []
    for row in connection.execute(_VERSIONS, (run_id,)):
        run, version, parent, created_at, step, metrics, *figures = row
        metrics = json.loads(metrics) if metrics else None
        stored = (run, version, parent, _timestamp(created_at), step, metrics, *figures)
        versions.append(VersionInfo.from_summary(stored, tags.get(version, [])))
    return versions


def _timestamp(stored: str) -> datetime:
    """A timestamp as the engine stores it in SQLite (UTC, without its zone), made aware again."""
    value = datetime.fromisoformat(stored)
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
