"""Manifest parts in the database: storing a version's parts, counting their versions, reading a
manifest back, and removing parts no version lists.

Each part is stored once (``manifest_parts`` + ``part_bodies``) with the tensor digests it
references (``part_refs``, written once per part, not once per version). A version row holds
its manifest's head and its part ids. ``manifest_parts.versions`` counts the versions listing a
part; a commit adds to it and a deletion takes from it in the same transaction as the version
row, always in part-id order (so two transactions never wait on each other's rows in opposite
orders). Garbage collection removes parts whose count is 0 under the exclusive collection lock;
commits hold the lock in share mode, so a part a commit relies on cannot go meanwhile.

A version row also holds the BLAKE3 of its whole assembled manifest text
(``versions.manifest_digest``): :func:`manifest_text` checks the text it assembles against it,
so a head or part body changed behind the store fails the load instead of loading other
metadata.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from blake3 import blake3
from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.orm import Session

from ckptstore.service.db.models import ManifestPart, PartBody, PartRef, Version, table
from ckptstore.service.db.session import insert_missing, rows_in
from ckptstore.service.errors import IntegrityError, StorageError
from ckptstore.service.format.parts import Part, assemble

BATCH = 500

_PARTS = table(ManifestPart)
_BODIES = table(PartBody)
_REFS = table(PartRef)
_VERSIONS = table(Version)

_KNOWN = select(_PARTS.c.digest, _PARTS.c.id, _PARTS.c.versions).where(
    _PARTS.c.digest.in_(bindparam("digests", expanding=True))
)
_COUNT = update(_PARTS).where(_PARTS.c.id == bindparam("pid")).values(versions=_PARTS.c.versions + bindparam("change"))
_BODIES_OF = select(_BODIES.c.part_id, _BODIES.c.body).where(_BODIES.c.part_id.in_(bindparam("ids", expanding=True)))
_HEAD = select(_VERSIONS.c.manifest, _VERSIONS.c.parts, _VERSIONS.c.manifest_digest).where(
    _VERSIONS.c.run_id == bindparam("run_id"), _VERSIONS.c.version == bindparam("version")
)
_PARTS_OF = select(_VERSIONS.c.parts).where(
    _VERSIONS.c.run_id == bindparam("run_id"), _VERSIONS.c.version.in_(bindparam("versions", expanding=True))
)
_UNLISTED = select(_PARTS.c.id).where(_PARTS.c.versions <= 0).order_by(_PARTS.c.id).limit(bindparam("limit"))


def known_parts(session: Session, digests: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``digest -> (id, versions listing it)`` for those of ``digests`` stored."""
    connection = session.connection()
    found: dict[str, tuple[int, int]] = {}
    for start in range(0, len(digests), BATCH):
        rows = rows_in(connection, _KNOWN, "digests", digests[start : start + BATCH])
        found.update((digest, (int(pid), int(count))) for digest, pid, count in rows)
    return found


def store_parts(session: Session, parts: Sequence[Part], known: dict[str, tuple[int, int]]) -> list[int]:
    """Store the parts not in ``known`` (with their bodies and references); every part's id, in order.

    Concurrent commits storing the same new part both succeed: each row is inserted or skipped.
    """
    fresh = {part.digest: part for part in parts if part.digest not in known}
    ids = {digest: pid for digest, (pid, _count) in known.items()}
    if fresh:
        insert_missing(session, ManifestPart, [{"digest": d, "versions": 0} for d in sorted(fresh)])
        ids.update((digest, pid) for digest, (pid, _count) in known_parts(session, sorted(fresh)).items())
        insert_missing(
            session,
            PartBody,
            [{"part_id": ids[d], "entries": len(p.entries), "body": p.body} for d, p in sorted(fresh.items())],
        )
        refs = [{"part_id": ids[d], "digest": t} for d, p in sorted(fresh.items()) for t in sorted(p.tensor_digests())]
        insert_missing(session, PartRef, refs)
    return [ids[part.digest] for part in parts]


def count_versions(session: Session, changes: Counter[int]) -> None:
    """Add ``changes[id]`` to each part's version count, in id order."""
    rows = [{"pid": pid, "change": change} for pid, change in sorted(changes.items()) if change]
    connection = session.connection()
    for start in range(0, len(rows), BATCH):
        connection.execute(_COUNT, rows[start : start + BATCH])


def release_versions(session: Session, run_id: str, versions: Iterable[int]) -> None:
    """Take the given versions of ``run_id`` (about to be deleted) off their parts' counts."""
    wanted = list(versions)
    changes: Counter[int] = Counter()
    connection = session.connection()
    for start in range(0, len(wanted), BATCH):
        for (parts,) in connection.execute(_PARTS_OF, {"run_id": run_id, "versions": wanted[start : start + BATCH]}):
            changes.subtract(_ids(parts))
    count_versions(session, changes)


def manifest_digest(text: str) -> str:
    """The digest a version row keeps of its manifest: BLAKE3 (hex) of the text's UTF-8 bytes."""
    # One thread: a 10,000-tensor manifest (about 3 MB) hashes in about 1.2 ms, faster than
    # handing it to a pool.
    return blake3(text.encode()).hexdigest()


def assembled_text(head: str, bodies: Sequence[str]) -> str | None:
    """The manifest text ``head`` and ``bodies`` assemble to, or None if the head cannot hold them."""
    try:
        return assemble(head, bodies)
    except ValueError:
        return None


def manifest_text(session: Session, run_id: str, version: int) -> str:
    """The whole manifest JSON text of a committed version, assembled from its head and parts.

    Raises:
        IntegrityError: the text does not hash to the version's ``manifest_digest`` (its head
            or a part's body was changed behind the store).
    """
    connection = session.connection()
    row = connection.execute(_HEAD, {"run_id": run_id, "version": version}).first()
    if row is None:  # pragma: no cover - callers resolve the version in the same transaction
        raise StorageError(f"version {version} of run {run_id!r} vanished while it was read")
    head, parts, expected = row
    ids = listed_ids(parts)
    bodies = stored_bodies(session, ids or [])
    listed = [bodies[pid] for pid in ids if pid in bodies] if ids is not None else []
    # A body's brackets are left out when it is spliced in: checked here, every byte it holds is.
    bracketed = all(len(body) > 1 and body[0] == "[" and body[-1] == "]" for body in listed)
    whole = ids is not None and len(listed) == len(ids) and bracketed
    text = assembled_text(head, listed) if whole else None
    if text is None or manifest_digest(text) != expected:
        raise IntegrityError(
            f"run {run_id!r} version {version}: its stored manifest does not match the digest it was committed "
            f"with (changed behind the store); run `ckptstore verify {run_id}@{version}`"
        )
    return text


def stored_bodies(session: Session, ids: Sequence[int]) -> dict[int, str]:
    """The JSON text of those of the parts ``ids`` that are stored."""
    connection = session.connection()
    bodies: dict[int, str] = {}
    unique = list(dict.fromkeys(ids))
    for start in range(0, len(unique), BATCH):
        found = connection.execute(_BODIES_OF, {"ids": unique[start : start + BATCH]})
        bodies.update((int(pid), body) for pid, body in found)
    return bodies


def part_bodies(session: Session, ids: Sequence[int]) -> dict[int, str]:
    """The JSON text of each of the parts ``ids`` (StorageError if one is not stored)."""
    bodies = stored_bodies(session, ids)
    absent = [pid for pid in dict.fromkeys(ids) if pid not in bodies]
    if absent:
        raise StorageError(f"manifest part {absent[0]} is listed but not stored")
    return bodies


def unlisted_parts(session: Session, limit: int) -> list[int]:
    """Up to ``limit`` ids of parts no version lists."""
    return [int(pid) for pid in session.connection().execute(_UNLISTED, {"limit": limit}).scalars()]


def delete_parts(session: Session, ids: Sequence[int]) -> None:
    """Delete the parts ``ids``, their bodies and their references."""
    for start in range(0, len(ids), BATCH):
        batch = list(ids[start : start + BATCH])
        session.execute(delete(PartRef).where(PartRef.part_id.in_(batch)))
        session.execute(delete(PartBody).where(PartBody.part_id.in_(batch)))
        session.execute(delete(ManifestPart).where(ManifestPart.id.in_(batch)))


def listed_ids(parts: Any) -> list[int] | None:
    """A version's part ids as read, or None if the column holds something else than a list of ids."""
    if not isinstance(parts, list) or not all(isinstance(pid, int) and not isinstance(pid, bool) for pid in parts):
        return None
    return parts


def _ids(parts: Any) -> list[int]:
    """A version's part ids as read (PostgreSQL's driver parses JSON; SQLAlchemy does for SQLite too)."""
    return [int(pid) for pid in parts]


__all__ = [
    "assembled_text",
    "count_versions",
    "delete_parts",
    "part_bodies",
    "known_parts",
    "listed_ids",
    "manifest_digest",
    "manifest_text",
    "release_versions",
    "store_parts",
    "stored_bodies",
    "unlisted_parts",
]
