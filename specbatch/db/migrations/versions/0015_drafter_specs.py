"""jobs.drafts holds the whole pool as drafter specs; the ngram column folds into it

A job's pool was ``drafts`` (draft models) plus ``ngram`` (a flag); it is now one list of drafter
spec strings (specbatch/engine/drafter_specs.py), the draft models first as before and "ngram" last
where the flag was set, the order ``parse_drafters`` gives. A model's spec string is its name, so
an old row reads back as the same pool and hashes to the same queue name. Downgrade splits the
"ngram" entry back out into the flag.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

NGRAM = "ngram"
JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def _jobs(*columns: sa.ColumnClause) -> sa.TableClause:
    return sa.table("jobs", sa.column("id", sa.String), sa.column("drafts", JSON), *columns)


def upgrade() -> None:
    jobs = _jobs(sa.column("ngram", sa.Boolean))
    conn = op.get_bind()
    for job_id, drafts in conn.execute(sa.select(jobs.c.id, jobs.c.drafts).where(jobs.c.ngram)).all():
        pool = [d for d in (drafts or []) if d != NGRAM] + [NGRAM]
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(drafts=pool))
    # a plain DROP COLUMN: a batch copy of the table would break the specbatch_results view on SQLite
    op.execute("ALTER TABLE jobs DROP COLUMN ngram")


def downgrade() -> None:
    op.add_column("jobs", sa.Column("ngram", sa.Boolean(), nullable=False, server_default=sa.false()))
    jobs = _jobs(sa.column("ngram", sa.Boolean))
    conn = op.get_bind()
    for job_id, drafts in conn.execute(sa.select(jobs.c.id, jobs.c.drafts)).all():
        if NGRAM in (drafts or []):
            models = [d for d in drafts if d != NGRAM]
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(drafts=models, ngram=True))
