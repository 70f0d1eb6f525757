"""results.grammar_drafted_tokens / grammar_accepted_tokens: structured outputs' forced tokens

The grammar's forced run proposed as a draft chain and how much of it was accepted
(docs/statistics.md). NULL on rows written before this migration; 0 for free text.

Revision ID: 0014
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0010"
branch_labels = None
depends_on = None

COLUMNS = ("grammar_drafted_tokens", "grammar_accepted_tokens")


def _view_0007() -> ModuleType:
    """0007's view builder: the view is 0007's with these columns added (the CSV's columns)."""
    path = Path(__file__).with_name("0007_results_view_columns.py")
    spec = importlib.util.spec_from_file_location("specbatch_migration_0007", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _create_view(extra: tuple[str, ...]) -> None:
    v = _view_0007()
    columns = [v._column("q", c) for c in (*v.REQUEST, *v.NEW_REQUEST)] + [
        "COALESCE(r.target, q.target, j.target) AS target",
        "CASE WHEN r.target IS NOT NULL THEN r.drafts WHEN q.target IS NOT NULL THEN q.drafts "
        "ELSE j.drafts END AS drafts",
    ] + [v._column("r", c) for c in (*v.RESULT, *v.NEW_RESULT, *extra)]
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.execute(v._view(columns, "JOIN jobs j ON j.id = q.job_id\n"))


def upgrade() -> None:
    # plain ADD COLUMNs: a batch copy of the table would break the specbatch_results view on SQLite
    for name in COLUMNS:
        op.add_column("results", sa.Column(name, sa.Integer(), nullable=True))
    _create_view(COLUMNS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")     # it reads the columns dropped next
    for name in COLUMNS:
        op.execute(f"ALTER TABLE results DROP COLUMN {name}")
    _create_view(())
