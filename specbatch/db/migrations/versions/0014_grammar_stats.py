"""results.grammar_drafted_tokens / grammar_accepted_tokens: structured outputs' forced tokens

The grammar's forced run proposed as a draft chain and how much of it was accepted
(docs/statistics.md). NULL on rows written before this migration; 0 for free text. The
specbatch_results view gains both, and 0013's cached_prompt_tokens / prefill_seconds_saved (the
CSV export's columns).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

COLUMNS = ("grammar_drafted_tokens", "grammar_accepted_tokens")
FROM_0013 = ("cached_prompt_tokens", "prefill_seconds_saved")

# the view as 0011 left it, self-contained (a migration must not change when the models or 0011 do)
STATS = (
    "verify_steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
    "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds", "verify_seconds",
    "wall_seconds", "tokens_per_second", "pool_wins", "final_gamma", "speculation_disabled",
)
REQUEST = ("job_id", "id AS request_id", "custom_id", "line_no", "kind", "status", "prompt", "messages",
           "params", "attempts", "error", "model", "prompt_ids", "metadata", "error_type", "error_param")
RESULT = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "token_ids", *STATS, "worker",
          "started_at", "finished_at", "latency_seconds", "draft_steps", "accepted_at_position",
          "batch_size_seconds", "lossy", "cached", "cached_from")
JSON_NULLABLE = ("messages", "prompt_ids", "metadata", "accepted_at_position")


def _column(table: str, spec: str) -> str:
    if spec in JSON_NULLABLE:
        return f"NULLIF({table}.{spec}, 'null') AS {spec}"
    return f"{table}.{spec}" if " AS " in spec else f"{table}.{spec} AS {spec}"


def _create_view(extra: tuple[str, ...]) -> None:
    columns = [_column("q", c) for c in REQUEST] + [
        "COALESCE(r.target, q.target, j.target) AS target",
        "CASE WHEN r.target IS NOT NULL THEN r.drafts WHEN q.target IS NOT NULL THEN q.drafts "
        "ELSE j.drafts END AS drafts",
        "COALESCE(r.sample_index, 0) AS sample_index",
    ] + [_column("r", c) for c in (*RESULT, *extra)]
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.execute("CREATE VIEW specbatch_results AS\nSELECT\n    " + ",\n    ".join(columns)
               + "\nFROM requests q\nJOIN jobs j ON j.id = q.job_id\n"
               "LEFT JOIN results r ON r.request_id = q.id\n")


def upgrade() -> None:
    # plain ADD COLUMNs: a batch copy of the table would break the specbatch_results view on SQLite
    for name in COLUMNS:
        op.add_column("results", sa.Column(name, sa.Integer(), nullable=True))
    _create_view((*COLUMNS, *FROM_0013))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")     # it reads the columns dropped next
    for name in COLUMNS:
        op.execute(f"ALTER TABLE results DROP COLUMN {name}")
    _create_view(())
