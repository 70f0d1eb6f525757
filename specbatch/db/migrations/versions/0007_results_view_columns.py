"""specbatch_results view: the columns added since 0001 (models, OpenAI fields, cached, lossy)

The view is what sqlite3 / psql users query (examples/results.sql); it now has the CSV export's
columns (specbatch/jobs/table.py FLAT_COLUMNS) plus the newer statistics. ``target`` / ``drafts``
are who produced the result where it recorded that, else the request's route, else the job's pair
(``drafts`` as stored: JSON, "ngram" included when the n-gram drafter ran).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

STATS = (
    "verify_steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
    "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds", "verify_seconds",
    "wall_seconds", "tokens_per_second", "pool_wins", "final_gamma", "speculation_disabled",
)
REQUEST = ("job_id", "id AS request_id", "custom_id", "line_no", "kind", "status", "prompt", "messages",
           "params", "attempts", "error")
RESULT = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "token_ids", *STATS, "worker",
          "started_at", "finished_at", "latency_seconds")
# added here (all columns added by 0002-0006 that a reader of results wants)
NEW_REQUEST = ("model", "prompt_ids", "metadata", "error_type", "error_param")
NEW_RESULT = ("draft_steps", "accepted_at_position", "batch_size_seconds", "lossy", "cached", "cached_from")


# nullable JSON columns: SQLAlchemy stores None as JSON null, which SQL sees as a value; the view
# shows SQL NULL, so `WHERE messages IS NULL` means what it says
JSON_NULLABLE = ("messages", "prompt_ids", "metadata", "accepted_at_position")


def _column(table: str, spec: str, sql_nulls: bool = True) -> str:
    if sql_nulls and spec in JSON_NULLABLE:
        return f"NULLIF({table}.{spec}, 'null') AS {spec}"
    return f"{table}.{spec}" if " AS " in spec else f"{table}.{spec} AS {spec}"


def _view(columns: list[str], joins: str) -> str:
    return ("CREATE VIEW specbatch_results AS\nSELECT\n    " + ",\n    ".join(columns)
            + f"\nFROM requests q\n{joins}LEFT JOIN results r ON r.request_id = q.id\n")


def upgrade() -> None:
    columns = [_column("q", c) for c in (*REQUEST, *NEW_REQUEST)] + [
        "COALESCE(r.target, q.target, j.target) AS target",
        # keyed on target, as specbatch/jobs/openai_output.py produced_by: a JSON column holds
        # JSON null, not SQL NULL, so COALESCE over drafts would stop at it
        "CASE WHEN r.target IS NOT NULL THEN r.drafts WHEN q.target IS NOT NULL THEN q.drafts "
        "ELSE j.drafts END AS drafts",
    ] + [_column("r", c) for c in (*RESULT, *NEW_RESULT)]
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.execute(_view(columns, "JOIN jobs j ON j.id = q.job_id\n"))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.execute(_view([_column("q", c, False) for c in REQUEST] + [_column("r", c, False) for c in RESULT], ""))
