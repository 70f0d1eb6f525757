"""HTTP API: files and batches tables; per-position accepted token counts on results

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Self-contained on purpose: a migration must not change when the models do.
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def Time() -> sa.DateTime:  # noqa: N802 - reads like a type
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("results", sa.Column("draft_steps", sa.Integer(), nullable=True))
    op.add_column("results", sa.Column("accepted_at_position", JSON, nullable=True))

    op.create_table(
        "api_files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(16), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_files")),
        sa.UniqueConstraint("batch_id", "kind", name=op.f("uq_api_files_batch_id_kind")),
    )
    op.create_index(op.f("ix_api_files_created_at"), "api_files", ["created_at"])

    op.create_table(
        "api_batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("errors", JSON, nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.Column("expires_at", Time(), nullable=False),
        sa.Column("failed_at", Time(), nullable=True),
        sa.Column("expired_at", Time(), nullable=True),
        sa.Column("finalized_at", Time(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_api_batches_job_id_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_batches")),
    )
    op.create_index(op.f("ix_api_batches_created_at"), "api_batches", ["created_at"])
    op.create_index(op.f("ix_api_batches_job_id"), "api_batches", ["job_id"])


def downgrade() -> None:
    op.drop_table("api_batches")
    op.drop_table("api_files")
    op.drop_column("results", "accepted_at_position")
    op.drop_column("results", "draft_steps")
