"""The runs of an embedded store, read with the standard library's ``sqlite3``: ``ckptstore ls``.

Listing the runs is what the command line does most, and opening a store through SQLAlchemy
costs its import (about 0.2 s of a half-second command) before a single row is read. An
embedded store is one SQLite file, so the listing reads it directly, read-only, with the one
statement :meth:`service.store.Store.runs` amounts to. It does so only where it knows the file:
a store at the schema revision this ckptstore's migrations end at. Anything else (no store yet,
another revision, a database that is locked, damaged or not SQLite) answers None, and the caller
opens the store the usual way, which migrates, refuses or explains. A test holds the two ways to
the same answer on stores built through the engine.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from pathlib import Path

from service.records import RunInfo
from service.revisions import head_revision

#: The embedded store's database file in its home folder (:meth:`service.store.Store.open_home`).
DATABASE_FILE = "metadata.db"

_RUNS = """
SELECT runs.id, runs.created_at, runs.updated_at, count(versions.version), max(versions.version),
       coalesce(sum(versions.bytes_total), 0), coalesce(sum(versions.bytes_new), 0)
FROM runs LEFT JOIN versions ON versions.run_id = runs.id
GROUP BY runs.id
ORDER BY runs.updated_at DESC, runs.id
"""


def read_runs(home: Path) -> list[RunInfo] | None:
    """Every run of the embedded store in ``home`` with its totals, most recently updated first,
    as :meth:`Store.runs` returns them; None where this reader does not apply (see above)."""
    path = Path(home).expanduser() / DATABASE_FILE
    if not path.is_file():
        return None
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return None
    try:
        (revision,) = connection.execute("SELECT version_num FROM alembic_version").fetchone() or (None,)
        if revision != head_revision():
            return None
        rows = connection.execute(_RUNS).fetchall()
    except (sqlite3.Error, TypeError, ValueError):
        return None
    finally:
        connection.close()
    try:
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
            for run_id, created_at, updated_at, count, latest, total, new in rows
        ]
    except (TypeError, ValueError):
        return None  # a value this reader does not know how to read: the engine will


def _timestamp(stored: str) -> datetime:
    """A timestamp as the engine stores it in SQLite (UTC, without its zone), made aware again."""
    value = datetime.fromisoformat(stored)
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
