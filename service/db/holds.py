"""Save holds: what a save in progress was told is present, or has stored, kept until it commits.

A save names itself by its commit key from its first call. Each call that makes a tensor needed
(reporting it present, recording a shard) holds those digests under that key, in the same
transaction and under the collection lock in share mode (:mod:`service.db.lock`), and renews
the save's lease. Garbage collection keeps every shard holding a tensor of a live save (one whose
lease was renewed within :data:`SAVE_LEASE_SECONDS`), whatever its grace period, so a save is
never told "present" about a tensor that is gone by the time it commits.

The save's commit removes its rows in the commit's transaction: from then on the version's
references keep what it needs. A save that never commits (killed, or abandoned) stops renewing;
once its lease has lapsed its holds protect nothing, and the next collection deletes them. The
rows never outgrow the saves in progress and the lapsed ones since the last collection.

Every transaction takes the save's lease row first, then tensors, then holds, each in key
order, so two transactions never wait for each other in a circle. A lease is renewed at most
once every :data:`RENEW_AFTER_SECONDS`: calls of one save running at once (a sharded save's
ranks, uploads in flight) then rarely wait for one another on its row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.orm import Session

from ckptstore.service.db.models import SaveHold, SaveLease, Tensor, table
from ckptstore.service.db.session import insert_columns, insert_new

#: A save whose last call was longer ago than this is taken for dead: its holds protect nothing.
SAVE_LEASE_SECONDS = 600
#: A lease renewed more recently than this is not renewed again (it lapses at least 9 minutes after
#: the save's last call).
RENEW_AFTER_SECONDS = 60

_LEASES = table(SaveLease)
_RENEW = (
    update(_LEASES)
    .where(_LEASES.c.key == bindparam("b_key"), _LEASES.c.renewed_at < bindparam("b_stale"))
    .values(renewed_at=bindparam("b_now"))
)
_SHARD_DIGESTS = select(Tensor.digest).where(Tensor.shard_id == bindparam("shard_id")).order_by(Tensor.digest)


def lease_cutoff(now: datetime) -> datetime:
    """The oldest renewal a live save can have at ``now``."""
    return now - timedelta(seconds=SAVE_LEASE_SECONDS)


def renew(session: Session, save_key: str, now: datetime) -> None:
    """Start or renew the lease of save ``save_key``; call it first in the transaction."""
    if not insert_new(session, SaveLease, {"key": save_key, "renewed_at": now}):
        stale = now - timedelta(seconds=RENEW_AFTER_SECONDS)
        session.connection().execute(_RENEW, {"b_key": save_key, "b_stale": stale, "b_now": now})


def hold(session: Session, save_key: str, digests: Iterable[str]) -> None:
    """Hold ``digests`` for save ``save_key`` (those it holds already stay), after :func:`renew`
    in the same transaction."""
    wanted = sorted(set(digests))
    if wanted:
        insert_columns(session, SaveHold, {"save_key": [save_key] * len(wanted), "digest": wanted})


def hold_shard(session: Session, save_key: str, shard_id: str) -> None:
    """Hold the digests of every tensor recorded in shard ``shard_id``, as :func:`hold`."""
    hold(session, save_key, session.connection().execute(_SHARD_DIGESTS, {"shard_id": shard_id}).scalars())


def release(session: Session, save_key: str) -> None:
    """Drop save ``save_key``'s holds and lease: it committed, and its version references what it needs."""
    session.execute(delete(SaveHold).where(SaveHold.save_key == save_key))
    session.execute(delete(SaveLease).where(SaveLease.key == save_key))


def held_shards(session: Session, now: datetime, among: Sequence[str] | None = None) -> set[str]:
    """The shards (of ``among``, or all) holding a tensor that a save alive at ``now`` holds."""
    statement = (
        select(Tensor.shard_id)
        .join(SaveHold, SaveHold.digest == Tensor.digest)
        .join(SaveLease, SaveLease.key == SaveHold.save_key)
        .where(SaveLease.renewed_at >= lease_cutoff(now))
        .distinct()
    )
    if among is None:
        return set(session.scalars(statement))
    found: set[str] = set()
    for start in range(0, len(among), 500):
        found.update(session.scalars(statement.where(Tensor.shard_id.in_(among[start : start + 500]))))
    return found


def drop_lapsed(session: Session, now: datetime) -> int:
    """Delete the holds and leases of saves whose lease had lapsed by ``now``; how many saves.
    Run under the collection lock held exclusively."""
    lapsed = select(SaveLease.key).where(SaveLease.renewed_at < lease_cutoff(now))
    session.execute(delete(SaveHold).where(SaveHold.save_key.in_(lapsed)))
    gone = session.execute(delete(SaveLease).where(SaveLease.renewed_at < lease_cutoff(now)))
    return int(getattr(gone, "rowcount", 0) or 0)


__all__ = [
    "RENEW_AFTER_SECONDS",
    "SAVE_LEASE_SECONDS",
    "drop_lapsed",
    "held_shards",
    "hold",
    "hold_shard",
    "lease_cutoff",
    "release",
    "renew",
]
