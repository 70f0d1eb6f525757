"""results: cache hits stored before this revision get started_at = finished_at

A results-cache hit is copied before any decoding, so it used to be stored with started_at NULL,
a hole in the exports and the specbatch_results view. New hits start and end at the moment they
are written (jobs/store.py record_cached_result); this gives the old ones the same value.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE results SET started_at = finished_at WHERE cached AND started_at IS NULL")


def downgrade() -> None:
    pass    # data only; the filled-in times are as true under 0007 as they are here
