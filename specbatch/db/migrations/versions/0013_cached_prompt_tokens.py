"""results.cached_prompt_tokens / prefill_seconds_saved: prompt tokens read from the prefix cache

A request whose prompt starts with a prefix that other requests share reads that prefix's KV
instead of prefilling it (specbatch/engine/prefix.py): OpenAI's
``usage.prompt_tokens_details.cached_tokens``. NULL on rows written before this revision.

Revision ID: 0013
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs: a batch copy of the table would break the specbatch_results view on SQLite
    op.add_column("results", sa.Column("cached_prompt_tokens", sa.Integer(), nullable=True))
    op.add_column("results", sa.Column("prefill_seconds_saved", sa.Float(), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE results DROP COLUMN prefill_seconds_saved")
    op.execute("ALTER TABLE results DROP COLUMN cached_prompt_tokens")
