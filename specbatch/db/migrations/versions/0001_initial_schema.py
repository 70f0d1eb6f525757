"""initial schema: jobs, requests, results and the specbatch_results view

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Self-contained on purpose: a migration must not change when the models do.
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Time() -> sa.DateTime:  # noqa: N802 - reads like a type
    return sa.DateTime(timezone=True)


def enum(name: str, *values: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=32)


STATS = (
    "verify_steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
    "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds", "verify_seconds",
    "wall_seconds", "tokens_per_second", "pool_wins", "final_gamma", "speculation_disabled",
)

VIEW_SQL = f"""
CREATE VIEW specbatch_results AS
SELECT
    q.job_id AS job_id,
    q.id AS request_id,
    q.custom_id AS custom_id,
    q.line_no AS line_no,
    q.kind AS kind,
    q.status AS status,
    q.prompt AS prompt,
    q.messages AS messages,
    q.params AS params,
    q.attempts AS attempts,
    q.error AS error,
    r.text AS text,
    r.finish_reason AS finish_reason,
    r.prompt_tokens AS prompt_tokens,
    r.completion_tokens AS completion_tokens,
    r.token_ids AS token_ids,
    {", ".join(f"r.{c} AS {c}" for c in STATS)},
    r.worker AS worker,
    r.started_at AS started_at,
    r.finished_at AS finished_at,
    r.latency_seconds AS latency_seconds
FROM requests q
LEFT JOIN results r ON r.request_id = q.id
"""


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("status", enum("job_status", "queued", "running", "completed", "completed_with_errors",
                                 "failed", "cancelling", "cancelled"), nullable=False),
        sa.Column("target", sa.String(512), nullable=False),
        sa.Column("drafts", JSON, nullable=False),
        sa.Column("ngram", sa.Boolean(), nullable=False),
        sa.Column("queue", sa.String(255), nullable=False),
        sa.Column("params", JSON, nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("metadata", JSON, nullable=False),
        *(sa.Column(c, sa.Integer(), nullable=False)
          for c in ("total", "pending", "running", "completed", "failed", "cancelled")),
        sa.Column("created_at", Time(), nullable=False),
        sa.Column("started_at", Time(), nullable=True),
        sa.Column("finished_at", Time(), nullable=True),
        sa.Column("cancel_requested_at", Time(), nullable=True),
        sa.Column("cancelled_at", Time(), nullable=True),
        sa.Column("updated_at", Time(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"])
    op.create_index(op.f("ix_jobs_status"), "jobs", ["status"])

    op.create_table(
        "requests",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", JSON, nullable=True),
        sa.Column("params", JSON, nullable=False),
        sa.Column("status", enum("request_status", "pending", "running", "completed", "failed",
                                 "cancelled"), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", Time(), nullable=True),
        sa.Column("started_at", Time(), nullable=True),
        sa.Column("finished_at", Time(), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_requests_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("job_id", "custom_id", name=op.f("uq_requests_job_id_custom_id")),
    )
    op.create_index("ix_requests_job_id_status", "requests", ["job_id", "status"])

    op.create_table(
        "results",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("request_id", ID, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", JSON, nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("verify_steps", sa.Integer(), nullable=False),
        sa.Column("drafted_tokens", sa.Integer(), nullable=False),
        sa.Column("accepted_tokens", sa.Integer(), nullable=False),
        sa.Column("acceptance_rate", sa.Float(), nullable=False),
        sa.Column("mean_acceptance_length", sa.Float(), nullable=False),
        sa.Column("accepted_per_position", JSON, nullable=False),
        sa.Column("target_forwards", sa.Integer(), nullable=False),
        sa.Column("draft_forwards", sa.Integer(), nullable=False),
        sa.Column("draft_seconds", sa.Float(), nullable=False),
        sa.Column("verify_seconds", sa.Float(), nullable=False),
        sa.Column("wall_seconds", sa.Float(), nullable=False),
        sa.Column("tokens_per_second", sa.Float(), nullable=False),
        sa.Column("pool_wins", JSON, nullable=False),
        sa.Column("final_gamma", sa.Integer(), nullable=False),
        sa.Column("speculation_disabled", sa.Boolean(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=False),
        sa.Column("started_at", Time(), nullable=True),
        sa.Column("finished_at", Time(), nullable=False),
        sa.Column("latency_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_results_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["request_id"], ["requests.id"],
                                name=op.f("fk_results_request_id_requests"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_results")),
        sa.UniqueConstraint("request_id", name=op.f("uq_results_request_id")),
    )
    op.create_index(op.f("ix_results_job_id"), "results", ["job_id"])

    op.execute(VIEW_SQL)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS specbatch_results")
    op.drop_table("results")
    op.drop_table("requests")
    op.drop_table("jobs")
