"""results.logprobs: per-token log-probabilities, packed (specbatch/jobs/logprobs.py)

NULL unless the request asked for logprobs. One binary value per result, not JSON per token:
a 100-token answer with 5 alternatives per token is ~7 KB.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN: a batch copy of the table would break the specbatch_results view on SQLite
    op.add_column("results", sa.Column("logprobs", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE results DROP COLUMN logprobs")
