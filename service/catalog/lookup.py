"""Asking the tensor index by digest or by size: what is missing, which sizes are held, where bytes live.

These are the questions a save asks before it sends anything (:func:`find_missing`,
:func:`sizes_held`) and a load asks before it reads (:func:`locate`). Each runs prebuilt Core
statements on the session's connection and reads plain tuples: building the statements per
call and the ORM's handling of their results took about half of a save's question.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Text, bindparam, select, type_coerce, update
from sqlalchemy.orm import Session

from ckptstore.service.db import Database, holds
from ckptstore.service.db.lock import hold_shared
from ckptstore.service.db.models import Tensor, table, utcnow
from ckptstore.service.db.session import rows_in
from ckptstore.service.db.shapes import ShapeCache
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.bounds import INT64_MAX, MAX_SIZES_PER_QUERY
from ckptstore.service.format.digest import all_digests, is_digest
from ckptstore.service.format.names import validate_commit_key
from ckptstore.service.format.records import TensorLocation

#: Digests per ``IN`` list of one statement.
QUERY_BATCH = 500
#: Rounds of asking for bases: a delta chain is at most this deep (gc keeps them far shorter).
MAX_CHAIN_LOOKUPS = 16
#: The most distinct digests one call asks about.
MAX_DIGESTS_PER_QUERY = 100_000

_TENSORS = table(Tensor)
_ANY_OF_SIZE = select(_TENSORS.c.nbytes).where(_TENSORS.c.nbytes == bindparam("nbytes")).limit(1)
_PRESENT = select(_TENSORS.c.digest).where(_TENSORS.c.digest.in_(bindparam("digests", expanding=True)))
# Rows another transaction is stamping right now are skipped rather than waited for: two saves
# asking about overlapping digests in different orders would otherwise deadlock, and the other
# stamp is as fresh as this one.
_STAMP_SEEN = (
    update(_TENSORS)
    .where(_TENSORS.c.digest.in_(_PRESENT.with_for_update(skip_locked=True).scalar_subquery()))
    .values(last_seen_at=bindparam("now"))
)
_LOCATE = select(
    _TENSORS.c.digest,
    _TENSORS.c.shard_id,
    _TENSORS.c.offset,
    _TENSORS.c.nbytes,
    _TENSORS.c.dtype,
    type_coerce(_TENSORS.c.shape, Text),
    _TENSORS.c.encoding,
    _TENSORS.c.stored_nbytes,
    _TENSORS.c.base,
).where(_TENSORS.c.digest.in_(bindparam("digests", expanding=True)))


def check_digests(digests: Iterable[str]) -> list[str]:
    """``digests`` without repeats, in input order.

    Raises:
        InvalidInputError: more than :data:`MAX_DIGESTS_PER_QUERY` of them, or one is not a digest.
    """
    unique = list(dict.fromkeys(digests))
    if len(unique) > MAX_DIGESTS_PER_QUERY:
        raise InvalidInputError(f"{len(unique)} digests in one request; the limit is {MAX_DIGESTS_PER_QUERY}")
    if not all_digests(unique):
        bad = next(d for d in unique if not is_digest(d))
        raise InvalidInputError(f"{str(bad)[:80]!r} is not a digest (64 lowercase hex characters)")
    return unique


def batches(items: Sequence[str], size: int = QUERY_BATCH) -> Iterable[Sequence[str]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def find_missing(*, db: Database, digests: Iterable[str], save_key: str | None = None) -> list[str]:
    """The digests among ``digests`` that no tensor row holds, in input order; see :meth:`Store.missing`.

    Those present are stamped as seen now and, for a save named by ``save_key``, held for it
    (:mod:`service.db.holds`), under the collection lock: a sweep either ran before (they are
    reported missing) or runs after and sees the stamp and the holds.
    """
    wanted = check_digests(digests)
    if save_key is not None:
        validate_commit_key(save_key)
    present: set[str] = set()
    now = utcnow()
    with db.transaction() as session:
        hold_shared(session)
        if save_key is not None:
            holds.renew(session, save_key, now)
        connection = session.connection()
        for batch in batches(wanted):
            found = sorted(connection.execute(_PRESENT, {"digests": batch}).scalars())
            if found:
                _stamp_seen(session, found, now)
            present.update(found)
        if save_key is not None:
            holds.hold(session, save_key, present)
    return [d for d in wanted if d not in present]


def _stamp_seen(session: Session, digests: Sequence[str], now: datetime) -> None:
    session.connection().execute(_STAMP_SEEN, {"digests": digests, "now": now})


def sizes_held(*, db: Database, sizes: Iterable[int]) -> set[int]:
    """Those of ``sizes`` that some stored tensor has; see :meth:`Store.sizes_held`.

    Raises:
        InvalidInputError: a size is not a positive integer, or more than
            :data:`MAX_SIZES_PER_QUERY` distinct sizes are asked about.
    """
    unique = set(sizes)
    if len(unique) > MAX_SIZES_PER_QUERY:
        raise InvalidInputError(f"{len(unique)} sizes in one request; the limit is {MAX_SIZES_PER_QUERY}")
    if any(type(size) is not int or not 1 <= size <= INT64_MAX for size in unique):
        raise InvalidInputError(f"tensor sizes must be integers from 1 to {INT64_MAX}")
    wanted = sorted(unique)
    with db.transaction() as session:
        connection = session.connection()
        return {size for size in wanted if connection.execute(_ANY_OF_SIZE, {"nbytes": size}).first()}


def locate(*, db: Database, digests: Iterable[str]) -> dict[str, TensorLocation]:
    """Where each digest's bytes live, and where those of every base an encoded delta among
    them is decoded with (its base, the base's base, …: a load reads them too).

    Raises:
        NotFoundError: naming how many digests the store lacks, and one of them.
    """
    wanted = check_digests(digests)
    found: dict[str, TensorLocation] = {}
    shapes = ShapeCache()
    bases: set[str] = set()  # of the deltas found in this round
    with db.transaction() as session:
        connection = session.connection()
        asking = wanted
        for _depth in range(MAX_CHAIN_LOOKUPS):
            before = len(found)
            for batch in batches(asking):
                # Plain tuples through a statement built once: an ORM object per tensor was a
                # third of loading a model of many small tensors, and expanding the IN list anew
                # for every batch 0.13 s of locating 32,768 tensors (see rows_in).
                rows = rows_in(connection, _LOCATE, "digests", batch)
                for digest, shard_id, offset, nbytes, dtype, shape, encoding, stored, base in rows:
                    if encoding is None:
                        found[digest] = TensorLocation(digest, shard_id, offset, nbytes, dtype, shapes(shape))
                    else:
                        found[digest] = TensorLocation(
                            digest, shard_id, offset, nbytes, dtype, shapes(shape), encoding, stored, base
                        )
                        if base is not None:
                            bases.add(base)
            if len(found) - before < len(asking):  # each digest asked is new and has one row
                break  # a digest (or a base) the store lacks: named below
            asking = sorted(base for base in bases if base not in found)
            bases.clear()
            if not asking:
                return found
    absent = [d for d in wanted if d not in found]
    if absent:
        raise NotFoundError(f"{len(absent)} tensors are not in the store, e.g. {absent[0]}")
    lost = sorted({loc.base for loc in found.values() if loc.base is not None and loc.base not in found})
    if lost:
        raise NotFoundError(f"{len(lost)} tensors that stored deltas decode from are not in the store, e.g. {lost[0]}")
    return found


__all__ = ["MAX_DIGESTS_PER_QUERY", "QUERY_BATCH", "batches", "check_digests", "find_missing", "locate", "sizes_held"]
