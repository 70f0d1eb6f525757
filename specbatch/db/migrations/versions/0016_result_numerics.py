"""results.numerics: how a result was decoded (device, dtype, kernels, processor, library versions)

``specbatch audit`` re-decodes a result with the target alone; on another device, dtype or
processor a near-tie can round the other way, which is numerics, not speculation. The record
lets the audit decode the same way and say what differs where it cannot (docs/CONTRACTS.md).
NULL for results written before.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN: a batch copy of the table would break the specbatch_results view on SQLite
    op.add_column("results", sa.Column("numerics", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE results DROP COLUMN numerics")
