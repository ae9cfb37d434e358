"""Manifest parts: a version's tensor entries are stored as content-addressed parts shared across
versions, and references are kept once per part (``part_refs``) instead of once per tensor per
version (``version_refs``).

Every stored manifest is split as a commit splits it (:mod:`service.format.parts`), so versions
committed after the upgrade share parts with those before it; the version row keeps the head
and the list of part ids. Downgrading assembles the manifests and the per-version references
again.

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import sqlalchemy as sa
from alembic import op

from ckptstore.service.format.manifest import manifest_from_json
from ckptstore.service.format.parts import assemble, head_json, split

revision = "0003"
down_revision = "0002"
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
)
_parts = sa.table("manifest_parts", sa.column("id", _PART_ID), sa.column("digest"), sa.column("versions"))
_bodies = sa.table("part_bodies", sa.column("part_id", _PART_ID), sa.column("entries"), sa.column("body"))
_part_refs = sa.table("part_refs", sa.column("part_id", _PART_ID), sa.column("digest"))
_version_refs = sa.table("version_refs", sa.column("run_id"), sa.column("version"), sa.column("digest"))


def _version_keys(connection: sa.Connection) -> list[tuple[str, int]]:
    query = sa.select(_versions.c.run_id, _versions.c.version).order_by(_versions.c.run_id, _versions.c.version)
    return [(run_id, int(version)) for run_id, version in connection.execute(query)]


def _one(connection: sa.Connection, run_id: str, version: int, *columns: Any) -> Any:
    where = (_versions.c.run_id == run_id) & (_versions.c.version == version)
    return connection.execute(sa.select(*columns).where(where)).one()


def upgrade() -> None:
    op.create_table(
        "manifest_parts",
        sa.Column("id", _PART_ID, autoincrement=True, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("versions", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("digest"),
    )
    op.create_table(
        "part_bodies",
        sa.Column("part_id", _PART_ID, nullable=False),
        sa.Column("entries", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["part_id"], ["manifest_parts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("part_id"),
    )
    op.create_table(
        "part_refs",
        sa.Column("part_id", _PART_ID, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["part_id"], ["manifest_parts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("part_id", "digest"),
    )
    op.create_index("ix_part_refs_digest", "part_refs", ["digest"])
    # Added with a default: SQLite adds a NOT NULL column in place only with one (rebuilding the
    # versions table instead would cascade the drop of the old table into tags).
    op.add_column("versions", sa.Column("parts", sa.JSON(), nullable=False, server_default="[]"))
    connection = op.get_bind()
    ids: dict[str, int] = {}
    counts: Counter[int] = Counter()
    for run_id, version in _version_keys(connection):
        (text,) = _one(connection, run_id, version, _versions.c.manifest)
        manifest = manifest_from_json(text)
        parts = split(manifest.tensors)
        for part in parts:
            if part.digest in ids:
                continue
            ids[part.digest] = len(ids) + 1
            connection.execute(sa.insert(_parts), {"id": ids[part.digest], "digest": part.digest, "versions": 0})
            connection.execute(
                sa.insert(_bodies), {"part_id": ids[part.digest], "entries": len(part.entries), "body": part.body}
            )
            refs = [{"part_id": ids[part.digest], "digest": d} for d in sorted(part.tensor_digests())]
            if refs:
                connection.execute(sa.insert(_part_refs), refs)
        listed = [ids[part.digest] for part in parts]
        counts.update(listed)
        where = (_versions.c.run_id == run_id) & (_versions.c.version == version)
        connection.execute(sa.update(_versions).where(where).values(manifest=head_json(manifest), parts=listed))
    for pid, count in counts.items():
        connection.execute(sa.update(_parts).where(_parts.c.id == pid).values(versions=count))
    if connection.dialect.name == "postgresql" and ids:
        # Ids were given here; the sequence must hand out the next ones.
        connection.exec_driver_sql(
            "SELECT setval(pg_get_serial_sequence('manifest_parts', 'id'), max(id)) FROM manifest_parts"
        )
    op.drop_index("ix_version_refs_digest", table_name="version_refs")
    op.drop_table("version_refs")


def downgrade() -> None:
    op.create_table(
        "version_refs",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["run_id", "version"], ["versions.run_id", "versions.version"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "version", "digest"),
    )
    op.create_index("ix_version_refs_digest", "version_refs", ["digest"])
    connection = op.get_bind()
    for run_id, version in _version_keys(connection):
        head, listed = _one(connection, run_id, version, _versions.c.manifest, _versions.c.parts)
        listed = json.loads(listed) if isinstance(listed, str) else listed
        query = sa.select(_bodies.c.part_id, _bodies.c.body).where(_bodies.c.part_id.in_(listed))
        bodies = {pid: body for pid, body in connection.execute(query)} if listed else {}
        text = assemble(head, [bodies[pid] for pid in listed])
        digests = {d for entry in manifest_from_json(text).tensors for d in entry.digests()}
        if digests:
            connection.execute(
                sa.insert(_version_refs), [{"run_id": run_id, "version": version, "digest": d} for d in sorted(digests)]
            )
        where = (_versions.c.run_id == run_id) & (_versions.c.version == version)
        connection.execute(sa.update(_versions).where(where).values(manifest=text))
    # Dropped in place, never by rebuilding the table (see upgrade).
    op.drop_column("versions", "parts")
    op.drop_index("ix_part_refs_digest", table_name="part_refs")
    op.drop_table("part_refs")
    op.drop_table("part_bodies")
    op.drop_table("manifest_parts")
