"""Commit keys: ``versions.commit_key``, the key a client named its commit by.

A commit whose answer was lost (a connection cut, a server restarted) can then be sent again:
the store answers with the version the key already committed instead of committing another.
Unique per run; versions committed without a key hold NULL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("versions", sa.Column("commit_key", sa.String(64), nullable=True))
    op.create_index("ix_versions_commit_key", "versions", ["run_id", "commit_key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_versions_commit_key", table_name="versions")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("commit_key")
