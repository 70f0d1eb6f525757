"""specbatch_database: one row, a random id this database keeps for life

A task names the database its job is in by this id (worker/enqueue.py), so a worker tells a task
of another database (a submitter with another SPECBATCH_DATABASE_URL on a broker both use) from
a job missing in its own: the first goes back to the queue for a worker of that database without
pausing this one's queue (docs/DESIGN.md, "Tasks of another database"). Not the URL: one
database has many URLs (localhost, a service name, a socket), and one URL can name two.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table("specbatch_database", sa.Column("id", sa.String(32), primary_key=True))
    op.bulk_insert(table, [{"id": uuid.uuid4().hex}])


def downgrade() -> None:
    op.drop_table("specbatch_database")
