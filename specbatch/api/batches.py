"""OpenAI Batches: create, retrieve, list, cancel; and specbatch's ``/v1/batches/{id}/stats``.

Creating a batch runs the CLI's own intake and submit path (jobs.intake + worker.submission) on
the stored file; the batch row is written in the job's transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection

from specbatch.api.auth import Keyed
from specbatch.api.deps import AppState
from specbatch.api.errors import BROKER_DOWN, ApiError
from specbatch.api.files import page
from specbatch.api.metadata import batch_options
from specbatch.api.models import Batch, BatchList, BatchStats, ExpiresAfter
from specbatch.api.responses import answer
from specbatch.errors import BrokerUnavailable, IntakeError
from specbatch.jobs import batches, files, intake
from specbatch.jobs.context import ContextCheck
from specbatch.worker.enqueue import check_broker
from specbatch.worker.submission import submit_job

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["batches"])


class CreateBatch(BaseModel):
    # an unknown field is a 400 naming it, as OpenAI's "Unrecognized request argument": silently
    # dropping a misspelt option would run the batch without it
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: ExpiresAfter | None = None


def _read(sb: AppState, c: Connection, rows: list[Any], jobs: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(Batch objects, []) and the output files of finished batches scheduled; or ([], ids of
    batches past their window), to be expired first. ``rows`` and ``jobs`` (by id): plain rows
    (``batches.read_batch_and_job``)."""
    overdue = [b.id for b in rows if batches.is_overdue(b, jobs.get(b.job_id or ""))]
    if overdue:
        return [], overdue
    for b in rows:
        if batches.needs_finalizing(b, jobs.get(b.job_id or "")):
            sb.finalizer.schedule(b.id)
    return batches.batch_objects(c, rows, jobs), []


def _expire(sb: AppState, batch_ids: list[str]) -> None:
    for batch_id in batch_ids:
        with sb.factory.begin() as s:
            batches.expire(s, batch_id)
    logger.info("expired %d batch(es) past their completion window", len(batch_ids))


def _object(sb: AppState, batch_id: str, owner: str | None) -> dict[str, Any]:
    """The tenant's Batch object (one read; an overdue batch is expired first)."""
    def read(c: Connection) -> tuple[list[dict[str, Any]], list[str]]:
        batch, job = batches.read_batch_and_job(c, batch_id, owner)
        return _read(sb, c, [batch], {job.id: job} if job is not None else {})

    for _ in range(2):
        objs, overdue = sb.read(read)
        if not overdue:
            return objs[0]
        _expire(sb, overdue)
    raise AssertionError(f"batch {batch_id} is still overdue after expiring it")


@router.post("/batches", response_model=Batch)
def create_batch(caller: Keyed, body: CreateBatch) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    if body.endpoint not in batches.ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(batches.ENDPOINTS)} (got {body.endpoint!r})",
                       param="endpoint")
    if body.completion_window not in batches.COMPLETION_WINDOWS:
        raise ApiError(400, f"completion_window must be one of {', '.join(batches.COMPLETION_WINDOWS)}",
                       param="completion_window")
    metadata, options = batch_options(body.metadata, sb.settings)
    pair, defaults = options.pair, options.defaults
    try:
        f = sb.read(lambda c: files.read_file(c, body.input_file_id, owner))
    except files.FileNotFound as e:     # the body's field names it, not the URL's `id`
        raise ApiError(404, str(e), param="input_file_id") from e
    purpose, filename = f.purpose, f.filename
    if purpose != "batch":
        raise ApiError(400, f"input file {body.input_file_id} has purpose {purpose!r}, not 'batch'",
                       param="input_file_id")
    check_broker(sb.settings, timeout=2.0)      # down: refuse before anything is written
    batch_id = batches.new_batch_id()
    fields: dict[str, Any] = {"batch_id": batch_id, "input_file_id": body.input_file_id, "endpoint": body.endpoint,
              "completion_window": body.completion_window, "metadata": metadata, "owner": owner}
    path = files.file_path(sb.settings, body.input_file_id)
    try:
        with path.open("rb") as fp:
            parsed = intake.read_stream(fp, filename, defaults, sb.settings, options.model_map,
                                        ContextCheck(sb.settings, pair.target, pair.drafts,
                                                     "metadata.specbatch_max_tokens"
                                                     if "specbatch_max_tokens" in metadata else "max_new_tokens"),
                                        intake.vocab_lookup(sb.settings.cache_dir, pair.target))
    except IntakeError as e:      # OpenAI's way: a failed batch that lists every bad line
        with sb.factory.begin() as s:
            batches.create_batch(s, **fields, errors=batches.intake_errors(e))
        return answer(_object(sb, batch_id, owner))
    mismatched = batches.endpoint_mismatches(parsed.requests, body.endpoint)
    if mismatched:
        with sb.factory.begin() as s:
            batches.create_batch(s, **fields, errors=mismatched)
        return answer(_object(sb, batch_id, owner))
    try:
        submitted = submit_job(sb.settings, sb.factory, parsed, pair=pair, defaults=defaults,
                               source=f"{body.input_file_id} ({filename})",
                               metadata={**metadata, "batch_id": batch_id},
                               with_job=lambda s, job_id: batches.create_batch(s, **fields, job_id=job_id))
    except BrokerUnavailable:
        with sb.factory.begin() as s:     # nobody will run it: end it now rather than leave it queued
            batches.fail(s, batch_id, [{"code": "broker_unavailable", "line": None, "param": None,
                                        "message": BROKER_DOWN}])
        raise
    sb.consumers.created(batch_id, submitted.sent)
    return answer(_object(sb, batch_id, owner))


@router.get("/batches", response_model=BatchList)
def list_batches(caller: Keyed, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    def read(c: Connection) -> tuple[list[dict[str, Any]], list[str], bool]:
        pairs, more = batches.list_batches(c, limit=limit, after=after, owner=owner)
        return *_read(sb, c, [b for b, _ in pairs], {j.id: j for _, j in pairs if j is not None}), more

    for _ in range(2):
        data, overdue, more = sb.read(read)
        if not overdue:
            return answer(page(data, more))
        _expire(sb, overdue)
    raise AssertionError("batches are still overdue after expiring them")


@router.get("/batches/{batch_id}", response_model=Batch)
def retrieve_batch(caller: Keyed, batch_id: str) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    return answer(_object(sb, batch_id, owner))


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
def cancel_batch(caller: Keyed, batch_id: str) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    with sb.factory.begin() as s:
        batches.cancel(s, batch_id, owner)
    return answer(_object(sb, batch_id, owner))


@router.get("/batches/{batch_id}/stats", response_model=BatchStats)
def batch_stats(caller: Keyed, batch_id: str) -> JSONResponse:
    """The job's acceptance and throughput statistics (``specbatch status --json``'s ``stats``)."""
    from specbatch.jobs import store

    sb, owner = caller.sb, caller.owner
    with sb.reader.begin() as s:
        batch = batches.get_batch(s, batch_id, owner)
        if batch.job_id is None:
            return answer({"object": "batch.stats", "id": batch_id, "job_id": None, "status": "failed",
                           "request_counts": None, "stats": None})
        summary = store.job_summary(s, batch.job_id)
    return answer({"object": "batch.stats", "id": batch_id, "job_id": summary["id"], "status": summary["status"],
                   "model": summary["target"], "drafts": summary["drafts"], "ngram": summary["ngram"],
                   "drafters": summary["drafters"],
                   "request_counts": summary["request_counts"], "stats": summary["stats"]})
