"""results: time by batch size and speculative steps (what the throughput autopilot chose)

Revision ID: 0005
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("results") as b:
        b.add_column(sa.Column("batch_size_seconds", JSON, nullable=False, server_default=sa.text("'{}'")))
        b.add_column(sa.Column("speculative_steps", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("results") as b:
        b.drop_column("speculative_steps")
        b.drop_column("batch_size_seconds")
