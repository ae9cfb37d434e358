"""Retention in the database: a run's stored policy, and removing what it does not keep.

The rules themselves (:class:`~service.catalog.retention_rules.Policy`, which versions to keep) are
pure and live in :mod:`service.catalog.retention_rules`; this module reads and writes a run's policy
and applies it inside the caller's transaction. :func:`service.catalog.commit.commit_version` calls
:func:`apply_policy` last, under the run's row lock, so concurrent commits apply the policy one
after another; tags, deletions and policy changes take the same lock
(:func:`service.catalog.versions.lock_run`).
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ckptstore.service.catalog.manifest_parts import release_versions
from ckptstore.service.catalog.retention_rules import Mode, Policy, versions_to_remove
from ckptstore.service.catalog.versions import lock_run, require_run
from ckptstore.service.db import Database
from ckptstore.service.db.models import RetentionPolicy as PolicyRow
from ckptstore.service.db.models import Tag, Version
from ckptstore.service.format.records import RetentionPolicy

DELETE_BATCH = 500


def read_policy(session: Session, run_id: str) -> Policy:
    """The run's policy (an inactive Policy when it has none)."""
    row = session.get(PolicyRow, run_id)
    if row is None:
        return Policy()
    mode: Mode | None = "max" if row.mode == "max" else "min" if row.keep_best is not None else None
    return Policy(keep_last=row.keep_last, keep_best=row.keep_best, metric=row.metric, mode=mode)


def write_policy(session: Session, run_id: str, policy: Policy) -> None:
    """Store ``policy`` for the run (whose row the caller has locked); an inactive one is removed."""
    row = session.get(PolicyRow, run_id)
    if not policy.active:
        if row is not None:
            session.delete(row)
        return
    if row is None:
        row = PolicyRow(run_id=run_id)
        session.add(row)
    row.keep_last, row.keep_best, row.metric, row.mode = policy.keep_last, policy.keep_best, policy.metric, policy.mode


def plan_removal(session: Session, run_id: str, policy: Policy) -> list[int]:
    """The versions of the run ``policy`` would remove now."""
    if not policy.active:
        return []  # no need to read the versions
    rows = session.execute(select(Version.version, Version.metrics).where(Version.run_id == run_id))
    versions = {number: metrics or {} for number, metrics in rows}
    tagged = set(session.scalars(select(Tag.version).where(Tag.run_id == run_id)))
    return versions_to_remove(policy, versions, tagged)


def describe_policy(session: Session, run_id: str, policy: Policy) -> RetentionPolicy:
    """The public record of the run's ``policy``, with the versions it would remove now."""
    return RetentionPolicy(
        run_id=run_id,
        keep_last=policy.keep_last,
        keep_best=policy.keep_best,
        metric=policy.metric,
        mode=policy.mode,
        would_remove=plan_removal(session, run_id, policy),
    )


def current_policy(*, db: Database, run_id: str) -> RetentionPolicy:
    """The run's policy and the versions it would remove now; NotFoundError if there is no such run."""
    with db.transaction() as session:
        require_run(session, run_id)
        return describe_policy(session, run_id, read_policy(session, run_id))


def replace_policy(*, db: Database, run_id: str, policy: Policy, create_run: bool) -> RetentionPolicy:
    """Store ``policy`` for the run, creating the run only if ``create_run``; see :meth:`Store.set_retention`."""
    with db.transaction() as session:
        lock_run(session, run_id, create=create_run)
        write_policy(session, run_id, policy)
        return describe_policy(session, run_id, policy)


def apply_now(*, db: Database, run_id: str) -> list[int]:
    """Remove now, in a transaction of its own, the versions the run's policy does not keep; their numbers."""
    with db.transaction() as session:
        lock_run(session, run_id)
        return apply_policy(session, run_id)


def apply_policy(session: Session, run_id: str) -> list[int]:
    """Remove the versions the run's policy does not keep; returns their numbers.

    The caller holds the run's row lock. Removed versions are taken off their manifest parts'
    counts; the parts no version lists any more, and their bytes, stay stored until garbage
    collection.
    """
    doomed = plan_removal(session, run_id, read_policy(session, run_id))
    for start in range(0, len(doomed), DELETE_BATCH):
        batch = doomed[start : start + DELETE_BATCH]
        release_versions(session, run_id, batch)
        statement = delete(Version).where(Version.run_id == run_id, Version.version.in_(batch))
        # Bulk delete: callers hold no ORM object of an older version (a commit holds only its new one).
        session.execute(statement.execution_options(synchronize_session=False))
    return doomed


__all__ = [
    "apply_now",
    "apply_policy",
    "current_policy",
    "describe_policy",
    "plan_removal",
    "read_policy",
    "replace_policy",
    "write_policy",
]
