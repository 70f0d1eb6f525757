"""requests: OpenAI batch fields (model, routed pair, metadata, token-id prompt) and the error's type

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Self-contained on purpose: a migration must not change when the models do.
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

COLUMNS = (
    ("error_type", sa.String(32)),
    ("error_param", sa.String(255)),
    ("model", sa.String(512)),
    ("target", sa.String(512)),
    ("drafts", JSON),
    ("metadata", JSON),
    ("prompt_ids", JSON),
)


def upgrade() -> None:
    # plain ALTER TABLE on both backends (SQLite >= 3.35 drops columns too): no table rebuild, so
    # the specbatch_results view over requests stays valid
    for name, type_ in COLUMNS:
        op.add_column("requests", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("requests", name)
