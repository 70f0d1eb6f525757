"""Tables: jobs, requests (one per prompt line), results (one per sample of a request: n).

Every timestamp is timezone-aware UTC in Python; SQLite stores it as naive UTC text.
The unique keys (job_id, custom_id) and (request_id, sample_index) make every write idempotent.
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy import text as sql_text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes in and out, on every backend (SQLite has no time zones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use specbatch.db.models.utcnow()")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


# JSONB on PostgreSQL (indexable, compact), JSON text elsewhere
JSONType = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments an INTEGER PRIMARY KEY
IdType = BigInteger().with_variant(Integer(), "sqlite")


class JobStatus(str, enum.Enum):
    queued = "queued"
    running = "running"
    completed = "completed"
    completed_with_errors = "completed_with_errors"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.completed, JobStatus.completed_with_errors, JobStatus.failed,
                        JobStatus.cancelled)


class RequestStatus(str, enum.Enum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


REQUEST_STATUSES = tuple(s.value for s in RequestStatus)


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # a VARCHAR + CHECK, not a native PostgreSQL ENUM: adding a status later is a plain migration
    return Enum(cls, name=name, native_enum=False, create_constraint=True, length=32,
                values_callable=lambda e: [m.value for m in e])


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class DatabaseIdentity(Base):
    """One row: the random id this database was given when created (migration 0017), which tasks
    carry to name their job's database (worker/enqueue.py; docs/DESIGN.md, "Tasks of another
    database")."""

    __tablename__ = "specbatch_database"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus, "job_status"), default=JobStatus.queued,
                                              index=True)
    target: Mapped[str] = mapped_column(String(512))
    # the pool, one drafter spec string each (engine/drafter_specs.py: "DIR", "ngram", ...)
    drafts: Mapped[list[str]] = mapped_column(JSONType, default=list)
    queue: Mapped[str] = mapped_column(String(255))
    params: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)   # the job's defaults
    source: Mapped[str | None] = mapped_column(Text)                      # the prompt file
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType, default=dict)
    # look results up in the results cache (jobs.result_cache); False: `--no-cache`
    cache: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # counters, refreshed from the rows by jobs.store.refresh_job
    total: Mapped[int] = mapped_column(Integer, default=0)
    pending: Mapped[int] = mapped_column(Integer, default=0)
    running: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    # one timestamp per status transition
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)        # first request claimed
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)       # completed[_with_errors]/failed
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # cancelling
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    requests: Mapped[list[Request]] = relationship(back_populates="job", lazy="raise",
                                                   passive_deletes=True)


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("job_id", "custom_id"),
        Index("ix_requests_job_id_status", "job_id", "status"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    custom_id: Mapped[str] = mapped_column(String(512))
    line_no: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))                 # "completion" | "chat"
    prompt: Mapped[str | None] = mapped_column(Text)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    params: Mapped[dict[str, Any]] = mapped_column(JSONType)      # resolved GenerationParams fields
    status: Mapped[RequestStatus] = mapped_column(_enum(RequestStatus, "request_status"),
                                                  default=RequestStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)            # the last error
    # who failed: "invalid_request_error" (the request's own fault) | "server_error"; exported as 400 / 500
    error_type: Mapped[str | None] = mapped_column(String(32))
    error_param: Mapped[str | None] = mapped_column(String(255))   # the request field at fault, if known
    # OpenAI batch lines: body.model as given, and where --model-map routed it (NULL: the job's pair)
    model: Mapped[str | None] = mapped_column(String(512))
    target: Mapped[str | None] = mapped_column(String(512))
    drafts: Mapped[list[str] | None] = mapped_column(JSONType)
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType)   # body.metadata, kept
    prompt_ids: Mapped[list[int] | None] = mapped_column(JSONType)   # a token-id completions prompt
    worker: Mapped[str | None] = mapped_column(String(255))    # who holds (or last held) the lease
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)   # last claim
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    job: Mapped[Job] = relationship(back_populates="requests", lazy="raise")
    results: Mapped[list[Result]] = relationship(back_populates="request", lazy="raise",
                                                 passive_deletes=True)   # one per sample


class Result(Base):
    __tablename__ = "results"
    # one row per sample of a request (parameter n; migration 0011)
    __table_args__ = (UniqueConstraint("request_id", "sample_index"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"))
    sample_index: Mapped[int] = mapped_column(Integer, default=0, server_default=sql_text("0"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(JSONType)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    # of those, read from the prefix cache instead of prefilled (0013; NULL on older rows)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    prefill_seconds_saved: Mapped[float | None] = mapped_column(Float)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(16))
    # statistics (docs/statistics.md)
    verify_steps: Mapped[int] = mapped_column(Integer, default=0)
    drafted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    acceptance_rate: Mapped[float] = mapped_column(Float, default=0.0)
    mean_acceptance_length: Mapped[float] = mapped_column(Float, default=0.0)
    accepted_per_position: Mapped[list[float]] = mapped_column(JSONType, default=list)
    # counts for counters summed across results (the API's /metrics); NULL on rows written before 0004
    draft_steps: Mapped[int | None] = mapped_column(Integer)
    accepted_at_position: Mapped[list[int] | None] = mapped_column(JSONType)
    target_forwards: Mapped[int] = mapped_column(Integer, default=0)
    draft_forwards: Mapped[int] = mapped_column(Integer, default=0)
    draft_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    verify_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    wall_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    pool_wins: Mapped[dict[str, int]] = mapped_column(JSONType, default=dict)
    final_gamma: Mapped[int] = mapped_column(Integer, default=0)
    speculation_disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # structured outputs' forced tokens (migration 0014); NULL on rows written before it
    grammar_drafted_tokens: Mapped[int | None] = mapped_column(Integer, default=0)
    grammar_accepted_tokens: Mapped[int | None] = mapped_column(Integer, default=0)
    # which models produced it (migration 0003); lossy: a --fallback-draft result, draft alone
    target: Mapped[str | None] = mapped_column(String(512))
    drafts: Mapped[list[str] | None] = mapped_column(JSONType)
    lossy: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # how it was decoded: device, dtype, kernels, processor, library versions (0016; NULL before)
    numerics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    # what the throughput autopilot chose (GenerationStats.batch_size_seconds)
    batch_size_seconds: Mapped[dict[str, float]] = mapped_column(JSONType, default=dict,
                                                                 server_default=sql_text("'{}'"))
    # who and when
    worker: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime)
    latency_seconds: Mapped[float] = mapped_column(Float)        # finished_at - started_at
    # the results cache (jobs.result_cache): the key of a deterministic request; a hit is a copy
    # marked cached, referring to the generated row it copies (a soft reference, see 0005)
    cache_key: Mapped[str | None] = mapped_column(String(64), index=True)
    cache_target: Mapped[str | None] = mapped_column(String(64))      # the target's fingerprint
    cached: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    cached_from: Mapped[int | None] = mapped_column(IdType)
    # per-token log-probabilities, packed (jobs/logprobs.py); NULL unless the request asked (0009)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)

    request: Mapped[Request] = relationship(back_populates="results", lazy="raise")


class ApiFile(Base):
    """A file of the HTTP API (OpenAI Files): an uploaded batch input, or a batch's output/error file.
    The bytes live in ``settings.files_dir`` under the id; this row is the index."""

    __tablename__ = "api_files"
    __table_args__ = (UniqueConstraint("batch_id", "kind"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(32))            # "batch" | "batch_output"
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer)                 # non-blank lines
    sha256: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str | None] = mapped_column(String(64))    # set on a batch's output/error file
    kind: Mapped[str | None] = mapped_column(String(16))        # "output" | "error" for those
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)   # the key's tenant (api/auth.py)


class ApiBatch(Base):
    """A batch of the HTTP API (OpenAI Batches): the job it created (none if its file was invalid)."""

    __tablename__ = "api_batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType, default=dict)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)   # validation errors
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalized_at: Mapped[datetime | None] = mapped_column(UTCDateTime)   # output files written
    owner: Mapped[str | None] = mapped_column(String(64), index=True)   # the key's tenant (api/auth.py)


STATS_COLUMNS = (
    "verify_steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
    "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds", "verify_seconds",
    "wall_seconds", "tokens_per_second", "pool_wins", "final_gamma", "speculation_disabled",
    "grammar_drafted_tokens", "grammar_accepted_tokens", "cached_prompt_tokens", "prefill_seconds_saved",
)

# The plain-SQL view for sqlite3 / psql users; created by the migrations (0001, columns in 0007).
RESULTS_VIEW = "specbatch_results"


def row_columns(model: type[Base], keys: tuple[str, ...] | None = None, prefix: str = "") -> list[Any]:
    """``model``'s columns (``keys`` of them, by attribute name; None: all) for a Core select, each
    labelled ``prefix`` + its attribute name: the plain rows it returns read like the model's
    objects (``row.meta``, not ``row.metadata``), without the ORM's loading of entities, which was
    most of a read's CPU on PostgreSQL (issue 32)."""
    columns = model.__mapper__.columns
    return [columns[key].label(prefix + key) for key in (keys or tuple(columns.keys()))]
