"""results: time by batch size (what the throughput autopilot chose)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


# plain ADD/DROP COLUMN, not batch mode: recreating the table on SQLite would break the
# specbatch_results view that reads it (these columns are not in the view)


def upgrade() -> None:
    op.add_column("results", sa.Column("batch_size_seconds", JSON, nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    op.drop_column("results", "batch_size_seconds")
