"""Batches of the HTTP API (OpenAI Batches) over jobs: creation records, status mapping, output files.

A batch is an ``api_batches`` row pointing at the job it created. A file that fails validation
makes a batch with no job, status ``failed`` and OpenAI's ``errors.data[{code, line, param,
message}]``. The job's lifecycle maps to OpenAI's statuses (README, "HTTP API"):

    queued, running                       -> in_progress
    completed[_with_errors], failed       -> finalizing, then completed once the files are written
    cancelling                            -> cancelling
    cancelled                             -> cancelling, then cancelled once the files are written
    past the window (job cancelled)       -> finalizing, then expired once the files are written

A request that failed on its own is a line of the error file; the batch still completes.
"""

from __future__ import annotations

import io
import json
import secrets
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TextIO, cast

from sqlalchemy import bindparam, case, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from specbatch.config import Settings
from specbatch.db.models import (
    REQUEST_STATUSES,
    ApiBatch,
    Job,
    JobStatus,
    Request,
    RequestStatus,
    Result,
    row_columns,
    utcnow,
)
from specbatch.errors import InputError, IntakeError, SpecBatchError
from specbatch.jobs import export, files, intake, openai_output, store
from specbatch.plural import plural

ENDPOINT_KINDS = intake.BATCH_URLS   # the lines each endpoint runs
ENDPOINTS = tuple(ENDPOINT_KINDS)
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_ERRORS = intake.KEPT_ERRORS


class BatchNotFound(SpecBatchError):
    """No batch with that id."""


class BatchEnded(SpecBatchError):
    """A batch that has ended cannot be cancelled: OpenAI's words, and its status 409 at the API."""

    def __init__(self, status: str) -> None:
        super().__init__(f"Cannot cancel a batch with status '{status}'.")


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


# ---------------------------------------------------------------- creation


def _error_code(e: InputError) -> str:
    reason = e.reason
    if e.line_no is None:
        return "invalid_file"
    if reason.startswith(("invalid JSON", "must be a JSON object", intake.NOT_TEXT)):
        return "invalid_json_line"
    if "bytes; the limit is" in reason:
        return "line_too_long"
    if reason.startswith("duplicate") or (e.field == "custom_id" and "taken" in reason):
        return "duplicate_custom_id"
    if "is required" in reason:
        return "missing_required_parameter"
    if reason.startswith(("unknown key", "unknown field")):     # a line's, a message's or a body's
        return "unknown_parameter"
    return "invalid_value"


def intake_errors(e: IntakeError) -> list[dict[str, Any]]:
    """OpenAI's ``errors.data`` entries for every problem intake found (at most MAX_ERRORS)."""
    out = [{"code": _error_code(x), "line": x.line_no, "param": x.field, "message": x.reason}
           for x in e.errors[:MAX_ERRORS]]
    if e.total > len(out):
        out.append({"code": "too_many_errors", "line": None, "param": None,
                    "message": f"{plural(e.total - len(out), 'more error')} not listed"})
    return out


def endpoint_mismatches(requests: Sequence[intake.ParsedRequest], endpoint: str) -> list[dict[str, Any]]:
    """OpenAI's ``url_mismatch`` errors: a batch runs one endpoint, so every line must be of its kind
    (a completions line in a chat batch would come back in the other endpoint's output shape, and a
    client reading the output as ChatCompletion objects would fail on it)."""
    kind = ENDPOINT_KINDS[endpoint]
    other = {v: k for k, v in ENDPOINT_KINDS.items()}
    bad = [r for r in requests if r.kind != kind]
    out = [{"code": "url_mismatch", "line": r.line_no, "param": "url",
            "message": f"a {other[r.kind]} request in a batch whose endpoint is {endpoint}: "
                       "a batch runs one endpoint; split the file"} for r in bad[:MAX_ERRORS]]
    if len(bad) > len(out):
        out.append({"code": "too_many_errors", "line": None, "param": None,
                    "message": f"{plural(len(bad) - len(out), 'more error')} not listed"})
    return out


def create_batch(s: Session, *, batch_id: str, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict[str, str], job_id: str | None = None,
                 errors: list[dict[str, Any]] | None = None, owner: str | None = None) -> ApiBatch:
    """The batch row; with ``errors`` (and no job) it is born failed."""
    now = utcnow()
    row = ApiBatch(id=batch_id, job_id=job_id, input_file_id=input_file_id, endpoint=endpoint,
                   completion_window=completion_window, meta=dict(metadata), errors=errors, created_at=now,
                   expires_at=now + COMPLETION_WINDOWS[completion_window],
                   failed_at=now if errors else None, owner=owner)
    s.add(row)
    s.flush()
    return row


# ---------------------------------------------------------------- reading


def get_batch(s: Session, batch_id: str, owner: str | None = None) -> ApiBatch:
    """The batch; BatchNotFound if it is not the tenant ``owner``'s (None: any tenant's)."""
    ours = batch_id.startswith("batch_") and len(batch_id) <= files.MAX_ID
    row = s.get(ApiBatch, batch_id) if ours else None
    if row is None or not files.visible(row, owner):
        raise BatchNotFound(f"No such Batch object: {files.shown_id(batch_id)}")
    return row


# a Batch object's rows, read as plain rows (no ORM entities: most of a read's CPU on PostgreSQL,
# issue 32): every column of the batch, of its job only those the object shows
JOB_FIELDS = ("id", "status", "target", "created_at", "finished_at", "cancel_requested_at", "cancelled_at")
BatchRow = namedtuple("BatchRow", ApiBatch.__mapper__.columns.keys())    # type: ignore[misc]
JobRow = namedtuple("JobRow", JOB_FIELDS)     # type: ignore[misc]
_BATCH_TABLE, _JOB_TABLE = cast(Any, ApiBatch.__table__), cast(Any, Job.__table__)
BATCHES_WITH_JOBS = (select(*row_columns(ApiBatch), *row_columns(Job, JOB_FIELDS, prefix="job_"))
                     .select_from(_BATCH_TABLE.outerjoin(_JOB_TABLE, _JOB_TABLE.c.id == _BATCH_TABLE.c.job_id)))
BATCH_AND_JOB = BATCHES_WITH_JOBS.where(_BATCH_TABLE.c.id == bindparam("batch_id"))


def _batch_and_job(row: Any) -> tuple[Any, Any]:
    """(BatchRow, JobRow or None) of a BATCHES_WITH_JOBS row: they read as ``ApiBatch`` and ``Job`` do."""
    n = len(BatchRow._fields)
    return BatchRow._make(row[:n]), (JobRow._make(row[n:]) if row[n] is not None else None)


def read_batch_and_job(c: files.Reader, batch_id: str, owner: str | None = None) -> tuple[Any, Any]:
    """The batch and its job as plain rows, in one statement; BatchNotFound as ``get_batch``."""
    ours = batch_id.startswith("batch_") and len(batch_id) <= files.MAX_ID
    row = c.execute(BATCH_AND_JOB, {"batch_id": batch_id}).first() if ours else None
    if row is None or not files.visible(row, owner):
        raise BatchNotFound(f"No such Batch object: {files.shown_id(batch_id)}")
    return _batch_and_job(row)


def list_batches(c: files.Reader, *, limit: int, after: str | None = None,
                 owner: str | None = None) -> tuple[list[tuple[Any, Any]], bool]:
    """The tenant's batches with their jobs (one query), as ``read_batch_and_job``'s pairs, newest
    first, ``after`` a batch id (OpenAI's cursor)."""
    rows, more = files.page_after(c, ApiBatch, BATCHES_WITH_JOBS, limit, after, descending=True, owner=owner)
    return [_batch_and_job(r) for r in rows], more


# the reads behind every Batch object, built once (building a statement and its cache key cost more
# CPU than running it on SQLite)
JOBS = select(Job).where(Job.id.in_(bindparam("ids", expanding=True)))
_COUNTS = (select(Request.job_id,
                  *(func.sum(case((Request.status == RequestStatus(status), 1), else_=0)).label(status)
                    for status in REQUEST_STATUSES))
           .where(Request.job_id.in_(bindparam("ids", expanding=True))).group_by(Request.job_id).subquery())
# a request's samples (parameter n) share its prompt: counted once, as OpenAI's usage does
_USAGE = (select(Result.job_id,
                 func.sum(case((Result.sample_index == 0, Result.prompt_tokens), else_=0)).label("prompt"),
                 func.sum(Result.completion_tokens).label("completion"),
                 func.sum(case((Result.sample_index == 0, Result.cached_prompt_tokens), else_=0)).label("cached"))
          .where(Result.job_id.in_(bindparam("ids", expanding=True))).group_by(Result.job_id).subquery())
# request counts and token usage per job in one statement: on PostgreSQL each statement is a round
# trip, and a Batch object's reads are most of a list or retrieve's time (issue 32)
TALLIES = (select(_COUNTS, _USAGE.c.prompt, _USAGE.c.completion, _USAGE.c.cached)
           .outerjoin(_USAGE, _USAGE.c.job_id == _COUNTS.c.job_id))


def jobs_of(s: Session, batches: Sequence[ApiBatch]) -> dict[str, Job]:
    ids = [b.job_id for b in batches if b.job_id]
    return {j.id: j for j in s.scalars(JOBS, {"ids": ids})} if ids else {}


def batch_status(batch: ApiBatch, job: Job | None) -> str:
    if job is None or batch.failed_at is not None:
        return "failed"
    status = JobStatus(job.status)
    if status == JobStatus.cancelling:
        return "cancelling"
    if status == JobStatus.cancelled:
        if batch.finalized_at is None:
            return "finalizing" if batch.expired_at else "cancelling"
        return "expired" if batch.expired_at else "cancelled"
    if status.finished:
        return "completed" if batch.finalized_at else "finalizing"
    return "in_progress"


def live_batches_of_file(s: Session, file_id: str) -> list[str]:
    """Ids of the batches that read ``file_id`` and still have requests to run (the file may not be
    deleted under them; finalizing writes the outputs from the database, not from the file)."""
    rows = list(s.scalars(select(ApiBatch).where(ApiBatch.input_file_id == file_id)))
    jobs = jobs_of(s, rows)
    return [b.id for b in rows if b.failed_at is None and (job := jobs.get(b.job_id or "")) is not None
            and not JobStatus(job.status).finished]


def needs_finalizing(batch: ApiBatch, job: Job | None) -> bool:
    return (job is not None and JobStatus(job.status).finished and batch.finalized_at is None
            and batch.failed_at is None)


def is_overdue(batch: ApiBatch, job: Job | None, now: datetime | None = None) -> bool:
    """Past its completion window with work left: to be expired (the job cancelled)."""
    return (job is not None and JobStatus(job.status) in store.ACTIVE_JOB and batch.expired_at is None
            and (now or utcnow()) >= batch.expires_at)


def expire(s: Session, batch_id: str) -> None:
    """Cancel an overdue batch's job (finished requests keep their results); idempotent."""
    batch = get_batch(s, batch_id)
    job = s.get(Job, batch.job_id) if batch.job_id else None
    if is_overdue(batch, job):
        assert job is not None
        store.cancel_job(s, job.id)
        batch.expired_at = utcnow()
        s.flush()


ENDED = ("completed", "failed", "expired")     # statuses whose batch OpenAI refuses to cancel


def cancel(s: Session, batch_id: str, owner: str | None = None) -> ApiBatch:
    """Cancel the batch's job: pending requests are dropped, running ones at their worker's next
    decoding step. BatchEnded for a batch that has ended (``ENDED``), as OpenAI refuses it; one
    cancelled, or finalizing, is returned unchanged."""
    batch = get_batch(s, batch_id, owner)
    job = s.get(Job, batch.job_id) if batch.job_id is not None else None
    status = batch_status(batch, job)
    if job is None or status in ENDED:      # (no job: failed at intake)
        raise BatchEnded(status)
    store.cancel_job(s, job.id)
    return batch


def fail(s: Session, batch_id: str, errors: list[dict[str, Any]]) -> None:
    """The batch could not start (its job is cancelled, if it has one)."""
    batch = get_batch(s, batch_id)
    if batch.job_id is not None:
        store.cancel_job(s, batch.job_id)
    batch.errors, batch.failed_at = errors, utcnow()
    s.flush()


def _ts(t: datetime | None) -> int | None:
    return int(t.timestamp()) if t is not None else None


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0      # input tokens read from the prefix cache (engine/prefix.py)

    def as_openai(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}


def tallies(s: files.Reader, job_ids: Sequence[str]) -> tuple[dict[str, dict[str, int]], dict[str, Usage]]:
    """Request counts ({total, pending, ...}, as ``store.request_counts``) and usage per job, one query."""
    counts = {j: dict.fromkeys(store.COUNT_NAMES, 0) for j in job_ids}
    if not job_ids:
        return counts, {}
    usage = {}
    for row in s.execute(TALLIES, {"ids": list(job_ids)}):
        job_id, by_status, (p, c, k) = row[0], row[1:-3], row[-3:]
        tally = counts[job_id]
        for status, n in zip(REQUEST_STATUSES, by_status, strict=True):
            tally[status] = int(n or 0)
        tally["total"] = sum(tally[status] for status in REQUEST_STATUSES)
        usage[job_id] = Usage(int(p or 0), int(c or 0), int(k or 0))
    return counts, usage


def batch_objects(s: files.Reader, batches: Sequence[Any], jobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """OpenAI's Batch object for each batch (two queries for the lot; one given the jobs, as
    ``jobs_of`` or ``read_batch_and_job`` read them). Batches and jobs: objects or plain rows."""
    if jobs is None:
        assert isinstance(s, Session), "a Connection reads a batch with its job (read_batch_and_job)"
        jobs = jobs_of(s, batches)
    counts, usage = tallies(s, list(jobs))
    return [batch_object(b, jobs.get(b.job_id or ""), counts.get(b.job_id or ""), usage.get(b.job_id or ""))
            for b in batches]


def batch_object(batch: Any, job: Any, counts: dict[str, int] | None,
                 usage: Usage | None) -> dict[str, Any]:
    status = batch_status(batch, job)
    c = counts or {}
    finalizing_at = None
    if job is not None and JobStatus(job.status).finished:
        finalizing_at = job.cancelled_at if job.status == JobStatus.cancelled else job.finished_at
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at),
        # the job is stored just before its batch row: never report it in progress before it exists
        "in_progress_at": max(_ts(job.created_at) or 0, _ts(batch.created_at) or 0) if job is not None else None,
        "expires_at": _ts(batch.expires_at),
        "finalizing_at": _ts(finalizing_at),
        "completed_at": _ts(batch.finalized_at) if status == "completed" else None,
        "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(job.cancel_requested_at) if job is not None else None,
        "cancelled_at": _ts(job.cancelled_at) if status == "cancelled" and job is not None else None,
        "request_counts": {"total": c.get("total", 0), "completed": c.get("completed", 0),
                           "failed": c.get("failed", 0) + c.get("cancelled", 0)},
        "metadata": dict(batch.meta) if batch.meta else None,     # (OpenAI's, for a batch created with none)
        "model": job.target if job is not None else None,
        "usage": (usage or Usage()).as_openai() if job is not None else None,
    }


# ---------------------------------------------------------------- output files


def write_pair(s: Session, job_id: str, out: TextIO, err: TextIO, expired: bool) -> tuple[int, int]:
    """OpenAI's output/error file pair (#13's lines and split). An expired batch's job was cancelled
    to stop its workers, so its cancelled requests are ``batch_expired`` lines, as OpenAI writes."""
    if not expired:
        return export.write_openai(s, job_id, out, err)
    counts = [0, 0]
    for line in openai_output.openai_lines(s, job_id, expired=True):
        if line["error"] is not None and line["error"]["code"] == "batch_cancelled":
            line["error"] = {"code": "batch_expired", "message": "the batch expired before this request was completed"}
        ok = openai_output.is_output_line(line)
        (out if ok else err).write(json.dumps(line, ensure_ascii=False) + "\n")
        counts[0 if ok else 1] += 1
    return counts[0], counts[1]


class _TallyWriter(io.TextIOBase):
    """A text stream that writes UTF-8 to ``fh`` and tallies what it wrote."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.tally = fh, files.Tally()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:  # type: ignore[override]
        data = text.encode("utf-8")
        self.tally.feed(data)
        self.fh.write(data)
        return len(text)


def finalize(settings: Settings, factory: sessionmaker, reader: sessionmaker, batch_id: str) -> bool:
    """Write a finished batch's output and error files; False if there was nothing to do (not
    finished, or already finalized, here or by another process)."""
    with reader.begin() as s:
        batch = get_batch(s, batch_id)
        job = s.get(Job, batch.job_id) if batch.job_id else None
        if not needs_finalizing(batch, job):
            return False
        expired = batch.expired_at is not None
        with files.incoming(settings) as out_tmp, files.incoming(settings) as err_tmp:
            with out_tmp.open("wb") as fo, err_tmp.open("wb") as fe:
                out, err = _TallyWriter(fo), _TallyWriter(fe)
                n_out, n_err = write_pair(s, batch.job_id or "", cast(TextIO, out), cast(TextIO, err),
                                          expired=expired)
            return _publish(settings, factory, batch_id, [("output", out_tmp, out.tally, n_out),
                                                          ("error", err_tmp, err.tally, n_err)])


def _publish(settings: Settings, factory: sessionmaker, batch_id: str,
             made: list[tuple[str, Any, files.Tally, int]]) -> bool:
    ids = {kind: files.new_file_id() if n else None for kind, _, _, n in made}
    with factory.begin() as s:
        claimed = s.execute(update(ApiBatch).where(ApiBatch.id == batch_id, ApiBatch.finalized_at.is_(None))
                            .values(finalized_at=utcnow(), output_file_id=ids["output"],
                                    error_file_id=ids["error"])).rowcount
        if not claimed:
            return False
        batch = s.get(ApiBatch, batch_id)
        owner = batch.owner if batch is not None else None     # the outputs are the batch's tenant's
        for kind, tmp, tally, _ in made:
            file_id = ids[kind]
            if file_id is None:
                continue
            files.place(settings, tmp, file_id)
            files.add_file(s, file_id=file_id, purpose="batch_output", filename=f"{batch_id}_{kind}.jsonl",
                           tally=tally.close(), batch_id=batch_id, kind=kind, owner=owner)
    return True
