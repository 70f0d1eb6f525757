"""results record the models that produced them, and whether the output is lossy

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


# plain ALTER TABLE ADD/DROP COLUMN (SQLite >= 3.35 too): a batch table copy would break the
# specbatch_results view, which reads the results table.
def upgrade() -> None:
    op.add_column("results", sa.Column("target", sa.String(512), nullable=True))
    op.add_column("results", sa.Column("drafts", JSON, nullable=True))
    # true only for --fallback-draft output: the draft alone, not the target's distribution
    op.add_column("results", sa.Column("lossy", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    for column in ("lossy", "drafts", "target"):
        op.execute(f"ALTER TABLE results DROP COLUMN {column}")
