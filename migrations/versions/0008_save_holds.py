"""Save holds: what a save in progress was told is present, or stored, kept until it commits.

- ``save_leases``: one row per save in progress, named by its commit key, with the time of its
  last call (``renewed_at``); a save is alive while that is within the lease;
- ``save_holds``: the digests each save holds; garbage collection keeps their tensors while
  the save is alive, whatever its grace period. A commit removes its save's rows; a collection
  removes those of saves whose lease lapsed.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "save_leases",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_save_leases_renewed_at", "save_leases", ["renewed_at"])
    op.create_table(
        "save_holds",
        sa.Column("save_key", sa.String(64), primary_key=True),
        sa.Column("digest", sa.String(64), primary_key=True),
    )
    op.create_index("ix_save_holds_digest", "save_holds", ["digest"])


def downgrade() -> None:
    op.drop_index("ix_save_holds_digest", table_name="save_holds")
    op.drop_table("save_holds")
    op.drop_index("ix_save_leases_renewed_at", table_name="save_leases")
    op.drop_table("save_leases")
