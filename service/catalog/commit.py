"""Committing a version inside one transaction: checks, numbering, figures, references."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, cast

from sqlalchemy import Text, bindparam, insert, select, type_coerce, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ColumnElement, Exists

from ckptstore.service.catalog.listings import SUMMARY_COLUMNS
from ckptstore.service.catalog.manifest_parts import count_versions, known_parts, manifest_digest, store_parts
from ckptstore.service.catalog.metadata_check import figures_digest
from ckptstore.service.catalog.retention import apply_policy
from ckptstore.service.db import Database, holds
from ckptstore.service.db.lock import hold_shared
from ckptstore.service.db.models import ManifestPart, PartRef, Run, Tag, Tensor, Version, table, utcnow
from ckptstore.service.db.session import insert_new, rows_in
from ckptstore.service.db.shapes import ShapeCache
from ckptstore.service.errors import ConflictError, InvalidManifestError, MissingTensorsError, format_list
from ckptstore.service.format.bounds import INT64_MAX, MAX_VERSION
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.manifest import ManifestBody, TensorEntry, stamp
from ckptstore.service.format.names import metrics_to_json, validate_commit_key, validate_run_id, validate_tag
from ckptstore.service.format.parts import assemble, head_json, split
from ckptstore.service.format.records import VersionInfo

BATCH = 500


_RUNS = table(Run)
_VERSIONS = table(Version)
_TENSORS = table(Tensor)
_REFS = table(PartRef)
_PARTS = table(ManifestPart)
_TAGS = table(Tag)

# Core statements on the session's connection, built once: the ORM's statements, objects and
# flushes took ~3 ms of a commit that adds one run update and one version row.
_LOCK_RUN = select(_RUNS.c.version_counter).where(_RUNS.c.id == bindparam("run_id")).with_for_update()
_LATEST = (
    select(_VERSIONS.c.version)
    .where(_VERSIONS.c.run_id == bindparam("run_id"))
    .order_by(_VERSIONS.c.version.desc())
    .limit(1)
)
_NUMBER_RUN = (
    update(_RUNS)
    .where(_RUNS.c.id == bindparam("run_id"))
    .values(version_counter=bindparam("number"), updated_at=bindparam("now"))
)
_ADD_VERSION = insert(_VERSIONS)
_KEYED = select(*SUMMARY_COLUMNS).where(
    _VERSIONS.c.run_id == bindparam("run_id"), _VERSIONS.c.commit_key == bindparam("commit_key")
)
_TAGS_OF = (
    select(_TAGS.c.name)
    .where(_TAGS.c.run_id == bindparam("run_id"), _TAGS.c.version == bindparam("version"))
    .order_by(_TAGS.c.name)
)


def _lock_run(session: Session, run_id: str) -> int:
    """Lock the run's row for this transaction (created on first commit); its version counter.

    Creating it is race-free: concurrent first commits of a run each insert-or-skip the row,
    then queue on its lock (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE`` has already
    serialized them). Each sees the counter as the previous holder committed it.
    """
    insert_new(session, Run, {"id": run_id, "version_counter": 0})
    return cast(int, session.connection().execute(_LOCK_RUN, {"run_id": run_id}).scalar_one())


def _listed_reference(digest: ColumnElement[str]) -> Exists:
    """Whether a part some committed version lists references ``digest`` (an EXISTS)."""
    return (
        select(_REFS.c.digest)
        .join(_PARTS, _PARTS.c.id == _REFS.c.part_id)
        .where(_REFS.c.digest == digest, _PARTS.c.versions > 0)
        .exists()
    )


# The shape as the database holds it: see ShapeCache. EXISTS stops at a digest's first listed
# reference, where reading the references themselves would take every part's.
_STORED = select(
    _TENSORS.c.digest,
    _TENSORS.c.dtype,
    type_coerce(_TENSORS.c.shape, Text),
    _TENSORS.c.nbytes,
    _listed_reference(_TENSORS.c.digest),
).where(_TENSORS.c.digest.in_(bindparam("digests", expanding=True)))
_EMPTY_LISTED = (
    select(_REFS.c.digest)
    .join(_PARTS, _PARTS.c.id == _REFS.c.part_id)
    .where(_REFS.c.digest.in_(bindparam("digests", expanding=True)), _PARTS.c.versions > 0)
    .distinct()
)


def _stored_tensors(session: Session, digests: list[str]) -> dict[str, tuple[str, Any, int, bool]]:
    """``digest -> (dtype, shape, nbytes, referenced)`` for those of ``digests`` stored.

    ``referenced``: whether some committed version references the digest already.
    """
    # One statement built at import, read as plain tuples on the session's connection, not ORM
    # objects or Row attributes: a small commit to a large manifest spends its time here
    # (checking 915 tensors took 7.9 ms, now 5.7), and a commit of 100,000 tensors should not
    # churn the garbage collector.
    found: dict[str, tuple[str, Any, int, bool]] = {}
    connection = session.connection()
    for start in range(0, len(digests), BATCH):
        rows = rows_in(connection, _STORED, "digests", digests[start : start + BATCH])
        found.update((digest, (dtype, shape, nbytes, referenced)) for digest, dtype, shape, nbytes, referenced in rows)
    return found


def _empty_referenced(session: Session, empty: list[str]) -> set[str]:
    """Those digests of empty tensors that some committed version references (they have no tensor row)."""
    seen: set[str] = set()
    connection = session.connection()
    for start in range(0, len(empty), BATCH):
        seen.update(connection.execute(_EMPTY_LISTED, {"digests": empty[start : start + BATCH]}).scalars())
    return seen


def _pieces(entry: TensorEntry) -> list[tuple[str, list[int]]]:
    if entry.digest is not None:
        return [(entry.digest, entry.shape)]
    return [(c.digest, c.shape) for c in entry.chunks or ()]


def check_references(session: Session, entries: Iterable[TensorEntry]) -> tuple[dict[str, int], set[str]]:
    """Check every digest of ``entries`` is stored with the dtype and shape the manifest claims.

    Returns the byte size of every distinct stored digest, and those of them some committed
    version references already. Empty pieces need no storage; their digest must be the
    digest of no bytes.
    """
    # Every claim is kept, not only the first: two keys may share a digest and each must agree.
    expected: dict[str, list[tuple[str, list[int], str]]] = {}
    sizes: dict[str, int] = {}
    for entry in entries:
        digest = entry.digest
        if digest is not None and 0 not in entry.shape:  # most entries: one whole, stored tensor
            claim = (entry.dtype, entry.shape, entry.key)
            claims = expected.get(digest)
            if claims is None:
                expected[digest] = [claim]
            else:
                claims.append(claim)
            continue
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
    empty = [d for d, n in sizes.items() if n == 0]
    seen = _empty_referenced(session, empty) if empty else set()
    shapes = ShapeCache()
    for digest, claims in expected.items():
        row_dtype, row_text, nbytes, referenced = stored[digest]
        row_shape = shapes(row_text)
        for dtype, shape, key in claims:
            if row_dtype != dtype or row_shape != shape:
                raise InvalidManifestError(
                    f"{key}: manifest says {dtype}{shape} but digest {digest[:16]}… is stored as {row_dtype}{row_shape}"
                )
        sizes[digest] = nbytes
        if referenced:
            seen.add(digest)
    return sizes, seen


def commit(
    db: Database, run_id: str, body: ManifestBody, *, tags: Sequence[str] = (), commit_key: str | None = None
) -> VersionInfo:
    """Commit ``body`` as the next version of ``run_id`` (created if new), in a transaction of its own.

    ``commit_key`` names this commit (a client's random token): sent again with the same key,
    as after a lost answer, the commit answers with the version it made the first time. It is
    also the key the save held its tensors under (:mod:`service.db.holds`): the commit releases them.

    Raises:
        MissingTensorsError: the body references digests the store lacks (listed).
        InvalidManifestError: a digest's dtype or shape disagrees with the stored tensor.
        InvalidNameError: a run id, tag or commit key not of its pattern.
    """
    validate_run_id(run_id)
    tags = [validate_tag(t) for t in tags]
    if commit_key is not None:
        validate_commit_key(commit_key)
    with db.transaction() as session:
        return commit_version(session, run_id, body, tags, commit_key)


def commit_version(
    session: Session, run_id: str, body: ManifestBody, tags: Sequence[str], commit_key: str | None = None
) -> VersionInfo:
    """Commit ``body`` as the next version of ``run_id`` within ``session``'s transaction.

    The run's retention policy is applied last, in the same transaction: versions it does not
    keep are removed as this version becomes visible (see :mod:`service.catalog.retention`). A
    ``commit_key`` a version of the run was committed with already answers with that version,
    and commits nothing: the client sent the same commit again (its answer was lost). That
    version is answered as it is now (with the tags it holds now).
    """
    # Before the reference check: a sweep either finished (the check sees what it removed) or
    # waits for this commit to end (and then sees its references).
    hold_shared(session)
    # The run is locked first: the references this commit finds already there are then those
    # every earlier commit to the run left, so its figures count what it alone adds.
    counter = _lock_run(session, run_id)
    if commit_key is not None:
        # After the lock: a repeat sent while the first is still committing waits for it, then sees it.
        connection = session.connection()
        done = connection.execute(_KEYED, {"run_id": run_id, "commit_key": commit_key}).first()
        if done is not None:
            holds.release(session, commit_key)
            held = connection.execute(_TAGS_OF, {"run_id": run_id, "version": done.version}).scalars()
            return VersionInfo.from_summary(done, list(held))
    if counter >= MAX_VERSION:
        raise ConflictError(f"run {run_id!r} has used every version number up to {MAX_VERSION}; save to a new run")
    # Parts some version lists were checked when first committed, and their tensors stay while
    # any version lists them (the collection lock is held): only the other parts are checked.
    parts = split(body.tensors)
    known = known_parts(session, [part.digest for part in parts])
    unchecked = [entry for part in parts if known.get(part.digest, (0, 0))[1] <= 0 for entry in part.entries]
    sizes, seen_before = check_references(session, unchecked)
    connection = session.connection()
    parent = connection.execute(_LATEST, {"run_id": run_id}).scalar()
    number = counter + 1
    now = utcnow()
    connection.execute(_NUMBER_RUN, {"run_id": run_id, "number": number, "now": now})
    new_digests = [d for d in sizes if d not in seen_before]
    bytes_total = bytes_trainable = 0
    lengths: dict[tuple[str, tuple[int, ...]], int] = {}  # a model's tensors share a few shapes
    for entry in body.tensors:
        layout = (entry.dtype, tuple(entry.shape))
        nbytes = lengths.get(layout, -1)
        if nbytes < 0:
            nbytes = lengths[layout] = entry.nbytes
        bytes_total += nbytes
        if entry.trainable:
            bytes_trainable += nbytes
    if bytes_total > INT64_MAX:  # entries may share digests, so the sum is not bounded by stored bytes
        raise InvalidManifestError(f"the manifest's tensors add up to {bytes_total} bytes; at most {INT64_MAX} fit")
    manifest = stamp(body, run_id=run_id, version=number, parent=parent, created_at=now)
    row: dict[str, Any] = {
        "run_id": run_id,
        "version": number,
        "parent": parent,
        "created_at": now,
        "step": body.step,
        "metrics": metrics_to_json(body.metrics),  # JSON: "NaN", never a bare NaN token
        "tensors_total": len(body.tensors),
        "tensors_new": len(new_digests),
        "bytes_total": bytes_total,
        "bytes_new": sum(sizes[d] for d in new_digests),
        "bytes_trainable": bytes_trainable,
    }
    part_ids = store_parts(session, parts, known)
    count_versions(session, Counter(part_ids))
    head = head_json(manifest)
    digests = {
        # Of the text a load assembles from the rows written here, not of another serialization.
        "manifest_digest": manifest_digest(assemble(head, [part.body for part in parts])),
        "figures_digest": figures_digest(run_id, number, row["tensors_new"], row["bytes_new"]),
    }
    connection.execute(_ADD_VERSION, {**row, **digests, "manifest": head, "parts": part_ids, "commit_key": commit_key})
    for name in dict.fromkeys(tags):
        existing = session.get(Tag, (run_id, name))
        if existing is None:
            session.add(Tag(run_id=run_id, name=name, version=number))
        else:
            existing.version = number
    session.flush()
    if commit_key is not None:  # the version's references keep what the save held from here on
        holds.release(session, commit_key)
    # Last, with the new version and its tags in place and the run still locked: its retention
    # policy sees exactly what this commit leaves, and commits to the run apply it in turn.
    apply_policy(session, run_id)
    return VersionInfo(**row, tags=sorted(dict.fromkeys(tags)))
