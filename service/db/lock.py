"""The collection lock: the ``store_locks`` row every transaction that makes a tensor or shard
needed takes in share mode, and a garbage collection's sweep takes exclusively.

Saves (intake), commits and lookups (catalog) hold it shared; the sweeps of garbage collection,
compaction and compression (reclaim) hold it exclusively. It lives with the database, not with
the collector, so what saves never imports what deletes (the interlock is told in
:mod:`service.reclaim.gc`).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.service.db.models import StoreLock
from ckptstore.service.db.session import insert_new

GC_LOCK = "gc"


def _lock(session: Session, *, exclusive: bool) -> None:
    statement = select(StoreLock.name).where(StoreLock.name == GC_LOCK).with_for_update(read=not exclusive)
    if session.execute(statement).first() is None:
        # Migration 0002 inserts the row; a database emptied by hand gets it back here.
        insert_new(session, StoreLock, {"name": GC_LOCK})
        session.execute(statement)


def hold_shared(session: Session) -> None:
    """Take the collection lock in share mode until ``session``'s transaction ends.

    Call it first in every transaction that makes a tensor or shard needed (reporting it
    present, recording it, committing a reference to it): no sweep runs while one is open.
    """
    _lock(session, exclusive=False)


def hold_exclusive(session: Session) -> None:
    """Take the collection lock exclusively: waits for, then blocks, every :func:`hold_shared`."""
    _lock(session, exclusive=True)
