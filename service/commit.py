"""Committing a version inside one transaction: checks, numbering, figures, references."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, insert, select
from sqlalchemy.orm import Session

from service.db.models import Run, Tag, Tensor, Version, VersionRef, utcnow
from service.db.session import insert_new
from service.errors import InvalidManifestError, MissingTensorsError, format_list
from service.format.digest import tensor_digest
from service.format.manifest import ManifestBody, TensorEntry, manifest_to_json, stamp
from service.gc import hold_shared
from service.records import VersionInfo
from service.retention import apply_policy

BATCH = 500


def _lock_run(session: Session, run_id: str) -> Run:
    """The run's row, locked for this transaction (created on first commit).

    Creating it is race-free: concurrent first commits of a run each insert-or-skip the row,
    then queue on its lock (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE`` has already
    serialized them). Each sees the counter as the previous holder committed it.
    """
    insert_new(session, Run, [{"id": run_id, "version_counter": 0}])
    locked = select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
    return session.execute(locked).scalar_one()


def _stored_tensors(session: Session, digests: list[str]) -> dict[str, Any]:
    # Plain rows, not ORM objects: a commit of 100,000 tensors should not churn the garbage collector.
    found: dict[str, Any] = {}
    columns = select(Tensor.digest, Tensor.dtype, Tensor.shape, Tensor.nbytes)
    for start in range(0, len(digests), BATCH):
        batch = digests[start : start + BATCH]
        found.update((row.digest, row) for row in session.execute(columns.where(Tensor.digest.in_(batch))))
    return found


def _referenced_before(session: Session, sizes: dict[str, int]) -> set[str]:
    """Those digests of ``sizes`` (digest -> bytes) that some committed version references."""
    seen: set[str] = set()
    stored = [d for d, n in sizes.items() if n > 0]
    for start in range(0, len(stored), BATCH):
        batch = stored[start : start + BATCH]
        # Each has a tensor row (checked in this transaction, which holds off sweeps). EXISTS stops
        # at a digest's first reference, where reading the references themselves would take every
        # version's, and a run's commits would slow down as versions sharing its weights add up.
        referenced = select(VersionRef.digest).where(VersionRef.digest == Tensor.digest).exists()
        seen.update(session.scalars(select(Tensor.digest).where(Tensor.digest.in_(batch), referenced)))
    # Empty tensors need no tensor row; there are few distinct ones.
    empty = [d for d, n in sizes.items() if n == 0]
    for start in range(0, len(empty), BATCH):
        batch = empty[start : start + BATCH]
        seen.update(session.scalars(select(VersionRef.digest).where(VersionRef.digest.in_(batch)).distinct()))
    return seen


def _add_references(session: Session, run_id: str, version: int, digests: list[str]) -> None:
    # Core executemany, not ORM objects: a version of 100,000 tensors adds as many rows, and
    # building, tracking and flushing an object per row was most of a small commit's time.
    table = cast(Table, VersionRef.__table__)
    for start in range(0, len(digests), BATCH):
        rows = [{"run_id": run_id, "version": version, "digest": d} for d in digests[start : start + BATCH]]
        session.execute(insert(table), rows)


def _pieces(entry: TensorEntry) -> list[tuple[str, list[int]]]:
    if entry.digest is not None:
        return [(entry.digest, list(entry.shape))]
    return [(c.digest, list(c.shape)) for c in entry.chunks or ()]


def check_references(session: Session, body: ManifestBody) -> dict[str, int]:
    """Check every digest is stored with the dtype and shape the manifest claims.

    Returns the byte size of every distinct stored digest. Empty pieces need no storage;
    their digest must be the digest of no bytes.
    """
    # Every claim is kept, not only the first: two keys may share a digest and each must agree.
    expected: dict[str, list[tuple[str, list[int], str]]] = {}
    sizes: dict[str, int] = {}
    for entry in body.tensors:
        for digest, shape in _pieces(entry):
            if 0 in shape:
                if digest != tensor_digest(entry.dtype, shape, b""):
                    raise InvalidManifestError(f"{entry.key}: empty tensor has a digest that is not of no bytes")
                sizes[digest] = 0
                continue
            expected.setdefault(digest, []).append((entry.dtype, shape, entry.key))
    stored = _stored_tensors(session, list(expected))
    absent = [d for d in expected if d not in stored]
    if absent:
        raise MissingTensorsError(
            f"{len(absent)} tensors referenced by the manifest are not stored: {format_list(absent, 5)}; "
            "upload their shards first",
            absent,
        )
    for digest, claims in expected.items():
        row = stored[digest]
        for dtype, shape, key in claims:
            if row.dtype != dtype or list(row.shape) != shape:
                raise InvalidManifestError(
                    f"{key}: manifest says {dtype}{shape} but digest {digest[:16]}… is stored as {row.dtype}{row.shape}"
                )
        sizes[digest] = row.nbytes
    return sizes


def commit_version(session: Session, run_id: str, body: ManifestBody, tags: Sequence[str]) -> VersionInfo:
    """Commit ``body`` as the next version of ``run_id`` within ``session``'s transaction.

    The run's retention policy is applied last, in the same transaction: versions it does not
    keep are removed as this version becomes visible (see :mod:`service.retention`).
    """
    # Before the reference check: a sweep either finished (the check sees what it removed) or
    # waits for this commit to end (and then sees its references).
    hold_shared(session)
    sizes = check_references(session, body)
    run = _lock_run(session, run_id)
    parent = session.scalar(
        select(Version.version).where(Version.run_id == run_id).order_by(Version.version.desc()).limit(1)
    )
    run.version_counter += 1
    number = run.version_counter
    now = utcnow()
    run.updated_at = now
    seen_before = _referenced_before(session, sizes)
    new_digests = [d for d in sizes if d not in seen_before]
    manifest = stamp(body, run_id=run_id, version=number, parent=parent, created_at=now)
    row = Version(
        run_id=run_id,
        version=number,
        parent=parent,
        created_at=now,
        step=body.step,
        metrics=dict(body.metrics),
        tensors_total=len(body.tensors),
        tensors_new=len(new_digests),
        bytes_total=sum(e.nbytes for e in body.tensors),
        bytes_new=sum(sizes[d] for d in new_digests),
        bytes_trainable=sum(e.nbytes for e in body.tensors if e.trainable),
        manifest=manifest_to_json(manifest),
    )
    session.add(row)
    session.flush()
    _add_references(session, run_id, number, list(sizes))
    for name in dict.fromkeys(tags):
        existing = session.get(Tag, (run_id, name))
        if existing is None:
            session.add(Tag(run_id=run_id, name=name, version=number))
        else:
            existing.version = number
    session.flush()
    # Last, with the new version and its tags in place and the run still locked: its retention
    # policy sees exactly what this commit leaves, and commits to the run apply it in turn.
    apply_policy(session, run_id)
    return VersionInfo(
        run_id=run_id,
        version=number,
        parent=parent,
        created_at=now,
        tags=sorted(dict.fromkeys(tags)),
        step=row.step,
        metrics=row.metrics,
        tensors_total=row.tensors_total,
        tensors_new=row.tensors_new,
        bytes_total=row.bytes_total,
        bytes_new=row.bytes_new,
        bytes_trainable=row.bytes_trainable,
    )
