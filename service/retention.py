"""Retention in the database: a run's stored policy, and removing what it does not keep.

The rules themselves (:class:`~service.retention_rules.Policy`, which versions to keep) are
pure and live in :mod:`service.retention_rules`; this module reads and writes a run's policy
and applies it inside the caller's transaction. :func:`service.commit.commit_version` calls
:func:`apply_policy` last, under the run's row lock, so concurrent commits apply the policy one
after another.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.db.models import RetentionPolicy as PolicyRow
from service.db.models import Run, Tag, Version
from service.db.session import insert_new
from service.errors import NotFoundError
from service.manifest_parts import release_versions
from service.records import RetentionPolicy
from service.retention_rules import Mode, Policy, versions_to_remove

DELETE_BATCH = 500


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
    "apply_policy",
    "describe_policy",
    "lock_run",
    "plan_removal",
    "read_policy",
    "write_policy",
]
