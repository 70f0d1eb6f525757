"""results cache: results.cache_key (indexed), cache_target, cached, cached_from; jobs.cache

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # plain ADD COLUMNs (no table rebuild on SQLite; the specbatch_results view stays valid)
    op.add_column("jobs", sa.Column("cache", sa.Boolean(), nullable=False, server_default=sa.true()))
    op.add_column("results", sa.Column("cache_key", sa.String(64), nullable=True))
    op.add_column("results", sa.Column("cache_target", sa.String(64), nullable=True))
    op.add_column("results", sa.Column("cached", sa.Boolean(), nullable=False, server_default=sa.false()))
    # a soft reference (no FOREIGN KEY): SQLite cannot add one without rebuilding the table
    op.add_column("results", sa.Column("cached_from", ID, nullable=True))
    op.create_index(op.f("ix_results_cache_key"), "results", ["cache_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_results_cache_key"), table_name="results")
    for column in ("cached_from", "cached", "cache_target", "cache_key"):
        op.drop_column("results", column)
    op.drop_column("jobs", "cache")
