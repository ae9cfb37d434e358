"""Encoded tensors (format v2): how each tensor is stored, what it needs to decode, which
versions garbage collection has compressed.

- ``tensors.encoding`` (NULL: raw), ``tensors.stored_nbytes`` (the payload's length; NULL: the
  raw length) and ``tensors.base`` (a delta's base digest);
- ``tensor_needs``: for each delta, every digest its decoding reads (its base, the base's
  base, …), so a tensor stays while any stored delta needs it;
- ``versions.compressed``: set once ``gc --compress`` has considered a version's new tensors,
  so a collection visits each version once.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tensors", sa.Column("encoding", sa.String(24), nullable=True))
    op.add_column("tensors", sa.Column("stored_nbytes", sa.BigInteger(), nullable=True))
    op.add_column("tensors", sa.Column("base", sa.String(64), nullable=True))
    op.create_table(
        "tensor_needs",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("needs", sa.String(64), primary_key=True),
    )
    op.create_index("ix_tensor_needs_needs", "tensor_needs", ["needs"])
    op.add_column("versions", sa.Column("compressed", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_index("ix_versions_compressed", "versions", ["compressed"])


def downgrade() -> None:
    op.drop_index("ix_versions_compressed", table_name="versions")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("compressed")
    op.drop_index("ix_tensor_needs_needs", table_name="tensor_needs")
    op.drop_table("tensor_needs")
    with op.batch_alter_table("tensors") as batch:
        batch.drop_column("base")
        batch.drop_column("stored_nbytes")
        batch.drop_column("encoding")
