"""Manifest digests: ``versions.manifest_digest`` and ``versions.figures_digest``.

``manifest_digest`` is the BLAKE3 of a version's whole manifest text as a load assembles it from
the head and the part bodies; a load refuses a manifest that no longer hashes to it.
``figures_digest`` covers the figures the manifest cannot give (``tensors_new``, ``bytes_new``).
``ckptstore verify`` checks both, each part body against its digest, and the listed columns
against the manifest. Existing versions are back-filled from what is stored, in batches.

Revision ID: 0007
Revises: 0006
Create Date: 2027-02-03
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op
from blake3 import blake3

from ckptstore.service.format.parts import assemble

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BATCH = 200
_PART_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_versions = sa.table(
    "versions",
    sa.column("run_id", sa.String),
    sa.column("version", sa.Integer),
    sa.column("manifest", sa.Text),
    sa.column("parts", sa.JSON),
    sa.column("tensors_new", sa.Integer),
    sa.column("bytes_new", sa.BigInteger),
    sa.column("manifest_digest", sa.String),
    sa.column("figures_digest", sa.String),
)
_bodies = sa.table("part_bodies", sa.column("part_id", _PART_ID), sa.column("body", sa.Text))


# The digests as this revision defines them, written out here so that later changes to the
# store's code cannot change what this migration wrote.
def _manifest_digest(text: str) -> str:
    return blake3(text.encode()).hexdigest()


def _figures_digest(run_id: str, version: int, tensors_new: Any, bytes_new: Any) -> str:
    text = json.dumps(
        {"run_id": run_id, "version": version, "tensors_new": tensors_new, "bytes_new": bytes_new},
        separators=(",", ":"),
    )
    return blake3(text.encode()).hexdigest()


def _next_batch(connection: sa.Connection, after: tuple[str, int] | None) -> list[Any]:
    """Up to BATCH versions after ``after`` in (run, version) order, with what their digests cover."""
    query = sa.select(
        _versions.c.run_id,
        _versions.c.version,
        _versions.c.manifest,
        _versions.c.parts,
        _versions.c.tensors_new,
        _versions.c.bytes_new,
    )
    if after is not None:
        run_id, version = after
        query = query.where(
            (_versions.c.run_id > run_id) | ((_versions.c.run_id == run_id) & (_versions.c.version > version))
        )
    return list(connection.execute(query.order_by(_versions.c.run_id, _versions.c.version).limit(BATCH)))


def _bodies_of(connection: sa.Connection, ids: set[int]) -> dict[int, str]:
    wanted = sorted(ids)
    found: dict[int, str] = {}
    for start in range(0, len(wanted), 500):
        query = sa.select(_bodies.c.part_id, _bodies.c.body).where(_bodies.c.part_id.in_(wanted[start : start + 500]))
        found.update((int(pid), body) for pid, body in connection.execute(query))
    return found


def _text(head: str, ids: list[int], bodies: dict[int, str]) -> str | None:
    """The manifest text a load assembles, or None where a part is missing or the head is damaged."""
    if not all(pid in bodies for pid in ids):
        return None
    try:
        return assemble(head, [bodies[pid] for pid in ids])
    except ValueError:
        return None


def upgrade() -> None:
    # Added with a default: SQLite adds a NOT NULL column in place only with one (rebuilding the
    # versions table instead would cascade the drop of the old table into tags). Every row gets
    # its digests below; an empty digest never matches, so a row left without one fails verify.
    op.add_column("versions", sa.Column("manifest_digest", sa.String(64), nullable=False, server_default=""))
    op.add_column("versions", sa.Column("figures_digest", sa.String(64), nullable=False, server_default=""))
    connection = op.get_bind()
    after: tuple[str, int] | None = None
    while True:
        rows = _next_batch(connection, after)
        if not rows:
            break
        bodies = _bodies_of(connection, {int(pid) for row in rows for pid in row.parts})
        for row in rows:
            values = {"figures_digest": _figures_digest(row.run_id, row.version, row.tensors_new, row.bytes_new)}
            text = _text(row.manifest, [int(pid) for pid in row.parts], bodies)
            if text is not None:  # else left without a digest, so verify names the version
                values["manifest_digest"] = _manifest_digest(text)
            where = (_versions.c.run_id == row.run_id) & (_versions.c.version == row.version)
            connection.execute(sa.update(_versions).where(where).values(**values))
        after = (rows[-1].run_id, rows[-1].version)


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("figures_digest")
        batch.drop_column("manifest_digest")
