"""Checking one version's stored metadata against the digests that cover it.

Every byte of a version's metadata that a load or a listing trusts is covered (see
``docs/FORMAT.md``, "Metadata digests"):

- each manifest part's body by the part's digest (the BLAKE3 of the body text), and the part's
  references (``part_refs``, which garbage collection keeps tensors by) by the digests the body
  names;
- the head and the list of parts by ``versions.manifest_digest``, the BLAKE3 of the whole
  assembled manifest text (loads check it too, :func:`service.catalog.manifest_parts.manifest_text`);
- the listed columns the manifest gives (``parent``, ``created_at``, ``step``, ``metrics``,
  ``tensors_total``, ``bytes_total``, ``bytes_trainable``) by the manifest itself;
- ``tensors_new`` and ``bytes_new``, which depend on what the store held at commit time and not
  on the manifest, by ``versions.figures_digest`` (:func:`figures_digest`).

:func:`check_version` reports each difference as a :class:`MetadataProblem`; it never raises for
damaged metadata, so ``ckptstore verify`` can name every problem of a version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from blake3 import blake3
from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from ckptstore.service.catalog.listings import SUMMARY_COLUMNS
from ckptstore.service.catalog.manifest_parts import (
    BATCH,
    assembled_text,
    listed_ids,
    manifest_digest,
    stored_bodies,
)
from ckptstore.service.catalog.versions import resolve_ref
from ckptstore.service.db import Database
from ckptstore.service.db.models import ManifestPart, PartRef, Version, table
from ckptstore.service.errors import CheckpointError
from ckptstore.service.format.names import metrics_to_json, validate_run_id
from ckptstore.service.format.records import MetadataProblem

_VERSIONS = table(Version)
_PARTS = table(ManifestPart)
_REFS = table(PartRef)

_ROW = select(
    *SUMMARY_COLUMNS,
    _VERSIONS.c.manifest,
    _VERSIONS.c.parts,
    _VERSIONS.c.manifest_digest,
    _VERSIONS.c.figures_digest,
).where(_VERSIONS.c.run_id == bindparam("run_id"), _VERSIONS.c.version == bindparam("version"))
_PART_DIGESTS = select(_PARTS.c.id, _PARTS.c.digest).where(_PARTS.c.id.in_(bindparam("ids", expanding=True)))
_PART_REFS = select(_REFS.c.part_id, _REFS.c.digest).where(_REFS.c.part_id.in_(bindparam("ids", expanding=True)))

#: The listed columns a manifest gives, in the order a problem list names them.
DERIVED_COLUMNS = ("parent", "created_at", "step", "metrics", "tensors_total", "bytes_total", "bytes_trainable")


def figures_digest(run_id: str, version: int, tensors_new: Any, bytes_new: Any) -> str:
    """The digest a version row keeps of the figures its manifest cannot give.

    BLAKE3 (hex) of the compact JSON text ``{"run_id":…,"version":…,"tensors_new":…,"bytes_new":…}``
    (keys in that order): the run and number tie the figures to their row.
    """
    text = json.dumps(
        {"run_id": run_id, "version": version, "tensors_new": tensors_new, "bytes_new": bytes_new},
        separators=(",", ":"),
    )
    return blake3(text.encode()).hexdigest()


def _short(digest: str) -> str:
    return f"{digest[:16]}…"


def _named_digests(body: str) -> set[str] | None:
    """The tensor digests a part body's entries name, or None if the body is not a list of entries."""
    try:
        entries = json.loads(body)
    except ValueError:
        return None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        return None
    named: set[str] = set()
    for entry in entries:
        pieces = [entry] if "digest" in entry else entry.get("chunks") or []
        named.update(str(piece.get("digest")) for piece in pieces if isinstance(piece, dict))
    return named


def _rows_by_part(session: Session, statement: Any, ids: list[int]) -> list[tuple[int, str]]:
    connection = session.connection()
    rows: list[tuple[int, str]] = []
    for start in range(0, len(ids), BATCH):
        found = connection.execute(statement, {"ids": ids[start : start + BATCH]})
        rows.extend((int(pid), value) for pid, value in found)
    return rows


def _part_problems(session: Session, ids: list[int], bodies: dict[int, str]) -> Iterable[tuple[str, str]]:
    """``(where, problem)`` for each listed part that is absent, or whose body or references
    do not match its digest."""
    unique = list(dict.fromkeys(ids))
    digests = dict(_rows_by_part(session, _PART_DIGESTS, unique))
    refs: dict[int, set[str]] = {}
    for pid, digest in _rows_by_part(session, _PART_REFS, unique):
        refs.setdefault(pid, set()).add(digest)
    for pid in unique:
        where = f"part {pid}"
        if pid not in bodies or pid not in digests:
            yield where, "listed by the version but not stored"
            continue
        actual = blake3(bodies[pid].encode()).hexdigest()
        if actual != digests[pid]:
            yield where, f"its body hashes to {_short(actual)}, not the part's digest {_short(digests[pid])}"
            continue
        named = _named_digests(bodies[pid])
        if named is not None and named != refs.get(pid, set()):
            held = refs.get(pid, set())
            yield (
                where,
                f"its references differ from the tensors its body names ({len(named - held)} missing, "
                f"{len(held - named)} extra): garbage collection keeps tensors by them",
            )


def _listed(row: Any) -> dict[str, Any]:
    return {name: getattr(row, name) for name in DERIVED_COLUMNS}


def _from_manifest(text: str) -> tuple[dict[str, Any], str, int] | str:
    """The listed columns the manifest text gives, with the run and version it names; or why it does not parse."""
    from ckptstore.service.format.manifest import manifest_from_json

    try:
        manifest = manifest_from_json(text)
    except CheckpointError as exc:
        return exc.message if len(exc.message) <= 200 else exc.message[:197] + "..."
    sizes = [entry.nbytes for entry in manifest.tensors]
    given = {
        "parent": manifest.parent,
        "created_at": manifest.created_at,
        "step": manifest.step,
        "metrics": metrics_to_json(manifest.metrics),  # as the column holds them: NaN as "NaN"
        "tensors_total": len(manifest.tensors),
        "bytes_total": sum(sizes),
        "bytes_trainable": sum(n for n, e in zip(sizes, manifest.tensors, strict=True) if e.trainable),
    }
    return given, manifest.run_id, manifest.version


def _shown(value: Any) -> str:
    text = value.isoformat() if hasattr(value, "isoformat") else json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_version(session: Session, run_id: str, version: int) -> list[MetadataProblem]:
    """Every way the stored metadata of ``run_id``'s ``version`` differs from what covers it (empty: none)."""
    row = session.connection().execute(_ROW, {"run_id": run_id, "version": version}).first()
    if row is None:  # pragma: no cover - callers resolve the version in the same transaction
        return [MetadataProblem(run_id=run_id, version=version, where="version", problem="vanished while checked")]
    found: list[tuple[str, str]] = []
    ids = listed_ids(row.parts)
    if ids is None:
        found.append(("parts", "the version's list of parts is not a list of part ids"))
    bodies = stored_bodies(session, ids or [])
    found.extend(_part_problems(session, ids or [], bodies))
    whole = ids is not None and all(pid in bodies for pid in ids)
    text = assembled_text(row.manifest, [bodies[pid] for pid in ids or []]) if whole else None
    if whole and text is None:
        found.append(("manifest", "its head does not start as a manifest head does, so no entries fit in it"))
    if text is not None:
        actual = manifest_digest(text)
        if actual != row.manifest_digest:
            expected = _short(row.manifest_digest)
            found.append(("manifest", f"it hashes to {_short(actual)}, not manifest_digest {expected}"))
        given = _from_manifest(text)
        if isinstance(given, str):
            found.append(("manifest", f"it does not parse: {given}"))
        else:
            columns, named_run, named_version = given
            if (named_run, named_version) != (run_id, version):
                found.append(("manifest", f"it names version {named_version} of run {named_run!r}"))
            for name, value in _listed(row).items():
                if value != columns[name]:
                    found.append((name, f"listed as {_shown(value)}, the manifest says {_shown(columns[name])}"))
    figures = figures_digest(run_id, version, row.tensors_new, row.bytes_new)
    if figures != row.figures_digest:
        found.append(
            (
                "tensors_new, bytes_new",
                f"{row.tensors_new} and {row.bytes_new} hash to {_short(figures)}, "
                f"not figures_digest {_short(row.figures_digest)}",
            )
        )
    return [MetadataProblem(run_id=run_id, version=version, where=where, problem=what) for where, what in found]


def check_metadata(*, db: Database, run_id: str, ref: int | str) -> list[MetadataProblem]:
    """What is wrong with the stored metadata of the version ``ref`` names; NotFoundError if it names none."""
    with db.transaction() as session:
        version = resolve_ref(session, validate_run_id(run_id), ref)
        return check_version(session, run_id, version)


__all__ = ["DERIVED_COLUMNS", "check_metadata", "check_version", "figures_digest"]
