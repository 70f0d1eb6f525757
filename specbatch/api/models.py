"""The JSON objects the API answers, as pydantic models: what ``/openapi.json`` (and ``/docs``)
names for each route's 200 answer.

For the schema only: routes build their objects as JSON-ready dicts and return them as a
``JSONResponse`` (``api.responses``), which FastAPI neither validates nor encodes again, so the
bytes on the wire are the dicts'. tests/api checks every answer against its model. Field names and
types follow OpenAI's ``Batch`` and ``FileObject`` (openai-python ``types/batch.py``,
``types/file_object.py``); ``BatchStats`` is specbatch's own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ExpiresAfter(BaseModel):
    """A request's ``expires_after`` (a file's) or ``output_expires_after`` (a batch's): OpenAI's
    bounds, checked so a bad value is a 400; files and outputs are kept until deleted anyway."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)   # 1 hour to 30 days


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None
    status_details: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    """A line of the input file that failed the batch (``line`` counts from 1)."""

    code: str | None
    line: int | None
    param: str | None
    message: str


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int         # failed, cancelled and expired requests: those in error_file_id


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                    "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None     # None: created with none, as OpenAI shows it
    model: str | None           # the job's target
    usage: BatchUsage | None


class FileList(BaseModel):
    """OpenAI's cursor page: ask again with ``after=last_id`` while ``has_more``."""

    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchList(BaseModel):
    """OpenAI's cursor page: ask again with ``after=last_id`` while ``has_more``."""

    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchStats(BaseModel):
    """``GET /v1/batches/{id}/stats``: the job's counts and statistics (``specbatch status --json``'s
    ``request_counts`` and ``stats``). A batch that failed before its job was made has no job:
    ``job_id``, ``request_counts`` and ``stats`` are null and the model fields absent."""

    object: Literal["batch.stats"]
    id: str
    job_id: str | None
    status: str                 # the job's status (specbatch's words), or "failed"
    model: str | None = None
    drafts: list[str] | None = None
    ngram: bool | None = None
    drafters: list[str] | None = None
    request_counts: dict[str, int] | None
    stats: dict[str, Any] | None
