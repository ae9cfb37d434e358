"""The initial schema: shards, tensors, runs, versions, version references and tags.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version_counter", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "shards",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "tensors",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("shard_id", sa.String(length=64), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["shard_id"], ["shards.id"]),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_index("ix_tensors_shard_id", "tensors", ["shard_id"], unique=False)
    op.create_table(
        "versions",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("tensors_total", sa.Integer(), nullable=False),
        sa.Column("tensors_new", sa.Integer(), nullable=False),
        sa.Column("bytes_total", sa.BigInteger(), nullable=False),
        sa.Column("bytes_new", sa.BigInteger(), nullable=False),
        sa.Column("bytes_trainable", sa.BigInteger(), nullable=False),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("run_id", "version"),
    )
    op.create_table(
        "tags",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run_id", "version"], ["versions.run_id", "versions.version"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"]),
        sa.PrimaryKeyConstraint("run_id", "name"),
    )
    op.create_table(
        "version_refs",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["run_id", "version"], ["versions.run_id", "versions.version"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "version", "digest"),
    )
    op.create_index("ix_version_refs_digest", "version_refs", ["digest"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_version_refs_digest", table_name="version_refs")
    op.drop_table("version_refs")
    op.drop_table("tags")
    op.drop_table("versions")
    op.drop_index("ix_tensors_shard_id", table_name="tensors")
    op.drop_table("tensors")
    op.drop_table("shards")
    op.drop_table("runs")
