"""Garbage collection and retention: tensors.last_seen_at, retention_policies, store_locks.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tensors") as batch:
        batch.add_column(sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "retention_policies",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("keep_last", sa.Integer(), nullable=True),
        sa.Column("keep_best", sa.Integer(), nullable=True),
        sa.Column("metric", sa.String(length=128), nullable=True),
        sa.Column("mode", sa.String(length=3), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_table(
        "store_locks",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.bulk_insert(sa.table("store_locks", sa.column("name", sa.String)), [{"name": "gc"}])


def downgrade() -> None:
    op.drop_table("store_locks")
    op.drop_table("retention_policies")
    with op.batch_alter_table("tensors") as batch:
        batch.drop_column("last_seen_at")
