"""HTTP API tenants: files and batches belong to the key (project) that made them

``owner`` is the project a key was given (``SPECBATCH_API_KEYS="proj:KEY"``) or a fingerprint of
a bare key; NULL for rows made before this revision or without keys (only an admin key, or a
server without keys, sees those).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("api_files", "api_batches"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("owner", sa.String(64), nullable=True))
            batch.create_index(op.f(f"ix_{table}_owner"), ["owner"])


def downgrade() -> None:
    for table in ("api_files", "api_batches"):
        with op.batch_alter_table(table) as batch:
            batch.drop_index(op.f(f"ix_{table}_owner"))
            batch.drop_column("owner")
