"""An index on tensors.nbytes: a save asks whether the store holds any tensor of a given size.

A tensor whose byte length no stored tensor has cannot be stored yet, so an embedded save
writes it at once and hashes it as it writes it (once), instead of hashing it first to ask.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_tensors_nbytes", "tensors", ["nbytes"])


def downgrade() -> None:
    op.drop_index("ix_tensors_nbytes", table_name="tensors")
