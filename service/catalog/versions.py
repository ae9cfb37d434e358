"""A run's versions by name: resolving a ref (a number, 'latest' or a tag), moving tags, deleting a version.

:func:`require_run` and :func:`resolve_ref` work inside the caller's transaction; the changes
open their own. Whatever changes which versions a retention policy would remove (a tag, a
deletion, the policy itself) first takes the run's row lock (:func:`lock_run`), as a commit
does, so it cannot interleave with a commit applying the policy.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptstore.service.catalog.manifest_parts import release_versions
from ckptstore.service.db import Database
from ckptstore.service.db.models import Run, Tag, Version
from ckptstore.service.db.session import insert_new
from ckptstore.service.errors import NotFoundError
from ckptstore.service.format.names import LATEST, parse_ref, validate_run_id, validate_tag


def lock_run(session: Session, run_id: str, *, create: bool = False) -> None:
    """Lock the run's row for this transaction, as commits do, creating it if ``create``.

    Whatever changes what a policy removes (tags, the policy itself, applying it) takes this
    lock, so it cannot interleave with a commit applying the policy. On SQLite every write
    transaction is already serialized by ``BEGIN IMMEDIATE``.
    """
    if create:
        insert_new(session, Run, {"id": run_id, "version_counter": 0})
    found = session.execute(select(Run.id).where(Run.id == run_id).with_for_update()).scalar_one_or_none()
    if found is None:
        raise NotFoundError(f"run {run_id!r} does not exist")


def require_run(session: Session, run_id: str) -> Run:
    """The run ``run_id``; NotFoundError if there is none."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id!r} does not exist")
    return run


def resolve_ref(session: Session, run_id: str, ref: int | str) -> int:
    """The version number ``ref`` (a number, 'latest' or a tag) names in ``run_id``; NotFoundError if none."""
    parsed = parse_ref(ref)
    require_run(session, run_id)
    if parsed == LATEST:
        latest = session.scalar(select(func.max(Version.version)).where(Version.run_id == run_id))
        if latest is None:
            raise NotFoundError(f"run {run_id!r} has no versions")
        return int(latest)
    if isinstance(parsed, int):
        if session.get(Version, (run_id, parsed)) is None:
            raise NotFoundError(f"run {run_id!r} has no version {parsed}")
        return parsed
    tag = session.get(Tag, (run_id, parsed))
    if tag is None:
        raise NotFoundError(f"run {run_id!r} has no tag {parsed!r}")
    return tag.version


def set_tag(*, db: Database, run_id: str, ref: int | str, name: str) -> int:
    """Point tag ``name`` at the version ``ref`` names, moving it if it exists; that version's number."""
    validate_tag(name)
    with db.transaction() as session:
        # Locked like a commit: a retention policy applied meanwhile must see this tag.
        lock_run(session, validate_run_id(run_id))
        version = resolve_ref(session, run_id, ref)
        existing = session.get(Tag, (run_id, name))
        if existing is None:
            session.add(Tag(run_id=run_id, name=name, version=version))
        else:
            existing.version = version
        return version


def remove_tag(*, db: Database, run_id: str, name: str) -> None:
    """Remove tag ``name`` from ``run_id`` (a reserved name too); NotFoundError if it has no such tag."""
    validate_tag(name, allow_reserved=True)
    with db.transaction() as session:
        existing = session.get(Tag, (validate_run_id(run_id), name))
        if existing is None:
            raise NotFoundError(f"run {run_id!r} has no tag {name!r}")
        session.delete(existing)


def remove_version(*, db: Database, run_id: str, ref: int | str) -> int:
    """Delete the version ``ref`` names, with its tags; its number. Its blobs stay until garbage collection."""
    with db.transaction() as session:
        lock_run(session, validate_run_id(run_id))  # a commit's retention may be removing it too
        version = resolve_ref(session, run_id, ref)
        session.query(Tag).filter_by(run_id=run_id, version=version).delete()
        release_versions(session, run_id, [version])
        row = session.get(Version, (run_id, version))
        session.delete(row)
        return version


__all__ = ["lock_run", "remove_tag", "remove_version", "require_run", "resolve_ref", "set_tag"]
