"""results.sample_index: one results row per sample of a request (parameter ``n``)

The unique key moves from (request_id) to (request_id, sample_index): a request with n = 4 has
four rows, 0..3; every existing row is sample 0. The specbatch_results view gains the column
(one view row per sample). On SQLite the key can only change by rebuilding the table, which the
view would block: the view is dropped first and created again after.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# the view of 0007, self-contained (a migration must not change when the models or 0007 do)
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


def _create_view(sample_index: bool) -> None:
    columns = [_column("q", c) for c in REQUEST] + [
        "COALESCE(r.target, q.target, j.target) AS target",
        "CASE WHEN r.target IS NOT NULL THEN r.drafts WHEN q.target IS NOT NULL THEN q.drafts "
        "ELSE j.drafts END AS drafts",
    ]
    if sample_index:   # 0 on a request without a result, as in the CSV export
        columns.append("COALESCE(r.sample_index, 0) AS sample_index")
    columns += [_column("r", c) for c in RESULT]
    op.execute("CREATE VIEW specbatch_results AS\nSELECT\n    " + ",\n    ".join(columns)
               + "\nFROM requests q\nJOIN jobs j ON j.id = q.job_id\n"
               "LEFT JOIN results r ON r.request_id = q.id\n")


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    with op.batch_alter_table("results") as batch:
        batch.add_column(sa.Column("sample_index", sa.Integer(), nullable=False, server_default=sa.text("0")))
        batch.drop_constraint("uq_results_request_id", type_="unique")
        batch.create_unique_constraint("uq_results_request_id_sample_index", ["request_id", "sample_index"])
    _create_view(True)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.execute("DELETE FROM results WHERE sample_index > 0")     # samples past the first: no key left
    with op.batch_alter_table("results") as batch:
        batch.drop_constraint("uq_results_request_id_sample_index", type_="unique")
        batch.create_unique_constraint("uq_results_request_id", ["request_id"])
        batch.drop_column("sample_index")
    _create_view(False)
