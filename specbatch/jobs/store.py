"""The job store's operations: plain functions taking the session first; they flush(), never commit().

Callers own the transaction and keep it short (never open while a model is generating):

    with session_factory(settings.database_url).begin() as s:
        claimed = store.claim_requests(s, ids, worker, settings.lease_seconds, settings.max_attempts)

Request lifecycle: pending -> running (claimed, with a lease) -> completed (a result row) | failed.
A running request whose lease expired is claimable again; the unique keys make every write
idempotent, so redelivered work never makes a second row.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Table, bindparam, case, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from specbatch.db.models import ApiBatch, Job, JobStatus, Request, RequestStatus, Result, utcnow
from specbatch.engine.drafter_specs import model_names, names, parse_drafters, pool_fields, without_models
from specbatch.engine.types import GenerationOutput, GenerationParams
from specbatch.errors import JobNotFound, SpecBatchError
from specbatch.jobs import logprobs
from specbatch.jobs.intake import ParsedRequest, params_from_dict
from specbatch.jobs.prefix_order import prefix_ordered
from specbatch.plural import plural

logger = logging.getLogger(__name__)

ACTIVE_JOB = (JobStatus.queued, JobStatus.running)
STOPPING_JOB = (JobStatus.cancelling, JobStatus.cancelled)
COUNT_NAMES = ("total", "pending", "running", "completed", "failed", "cancelled")
# Request.error_type values, OpenAI's error types: exported as status 400 and 500
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class ClaimedRequest:
    """A request a worker now holds a lease on; everything it needs to generate."""

    id: int
    job_id: str
    custom_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: GenerationParams
    attempts: int
    input_ids: list[int] | None = None      # a token-id prompt (then ``prompt`` is None)


def new_job_id() -> str:
    return secrets.token_hex(6)


# ---------------------------------------------------------------- jobs


def create_job(s: Session, *, target: str, drafts: list[str], params: dict[str, Any],
               requests: list[ParsedRequest], queue: str, source: str | None = None,
               metadata: dict[str, Any] | None = None, cache: bool = True) -> Job:
    """A queued job with one pending request row per parsed line (one bulk insert). ``drafts``:
    the pool's drafter specs as strings (``Pair.drafts``).

    ``cache=False`` (``--no-cache``): its requests never take a result from the results cache."""
    now = utcnow()
    job = Job(id=new_job_id(), status=JobStatus.queued, target=target, drafts=list(drafts),
              queue=queue, params=dict(params), source=source, meta=dict(metadata or {}),
              cache=cache,
              total=len(requests), pending=len(requests), created_at=now, updated_at=now)
    s.add(job)
    s.flush()
    if requests:
        s.execute(_table(Request).insert(), [
            {"job_id": job.id, "custom_id": r.custom_id, "line_no": r.line_no, "kind": r.kind,
             "prompt": r.prompt, "messages": r.messages, "params": r.params,
             "status": RequestStatus.pending.value, "attempts": 0, "created_at": now,
             "model": r.model, "target": r.target, "drafts": r.drafts, "metadata": r.metadata,
             "prompt_ids": r.prompt_ids}
            for r in requests])
    return job


def get_job(s: Session, job_id: str) -> Job:
    """The job with this id, with this unique id prefix (at least 4 characters), or of this HTTP API
    batch (``batch_...``: the id an API user holds)."""
    job = s.get(Job, job_id)
    if job is not None:
        return job
    batch = s.get(ApiBatch, job_id) if job_id.startswith("batch_") else None
    if batch is not None:
        if batch.job_id is None:
            raise JobNotFound(f"batch {job_id} has no job: its input file failed validation "
                              f"(GET /v1/batches/{job_id} lists why)")
        return s.get_one(Job, batch.job_id)
    if len(job_id) >= 4:
        matches = s.scalars(select(Job).where(Job.id.startswith(job_id, autoescape=True)).limit(2)).all()
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise JobNotFound(f"job id {job_id!r} is ambiguous; give more characters")
    short = " (a prefix needs at least 4 characters)" if len(job_id) < 4 else ""
    raise JobNotFound(f"no job {job_id!r}{short}; `specbatch jobs` lists the jobs")


def list_jobs(s: Session, limit: int = 50) -> list[Job]:
    """The newest jobs first."""
    return list(s.scalars(select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))


EMBEDDED = "embedded"   # the job's meta key that says `specbatch run` made it (run_in_its_process)
RUNNER = "run_by"       # ... and the one naming the `specbatch run` processes that run it now (set_runner)


def run_in_its_process(meta: dict[str, Any] | None) -> bool:
    """Whether a job (its ``meta``) was made by ``specbatch run``: that process (or a later ``run
    --resume`` / ``resume``) decodes its rows, with no broker; a worker's sweeps never send them."""
    return bool((meta or {}).get(EMBEDDED))


# built once: building a statement and its cache key took a fifth of the API's CPU per Batch object
COUNTS = (select(Request.job_id, Request.status, func.count())
          .where(Request.job_id.in_(bindparam("ids", expanding=True))).group_by(Request.job_id, Request.status))


def set_runner(s: Session, job_id: str, runner: str, running: bool = True) -> None:
    """Record ``runner`` (its lease-holder name, ``NODE@HOST:PID``) among the `specbatch run`
    processes that run the job, before it loads a pair: a run killed while it holds no rows
    (loading its models, a next --model-map pair) is then known to be gone (``run_gone``); with
    ``running`` False, a run that ended takes its name back. Every run is kept, not the last: a
    second `run --resume` of the job must not stand for a first that still loads its next pair."""
    job = _locked_job(s, job_id)    # (two runs name themselves at once)
    names = runners(job.meta)
    kept = [n for n in names if n != runner] + ([runner] if running else [])
    if kept != names:
        job.meta = {**(job.meta or {}), RUNNER: kept}
        s.flush()


def _locked_job(s: Session, job_id: str) -> Job:
    """The job read afresh with its row locked until the transaction ends, for a read-modify-write
    of its ``meta`` (one JSON column): two runs changing different keys at once would otherwise
    each write back the meta it read, the other's key lost. FOR UPDATE on PostgreSQL (SQLite's
    writers take the file's lock at BEGIN IMMEDIATE); a refresh, as the session may hold a copy it
    read before the lock, after a flush: a refresh drops the session's unflushed changes."""
    job = get_job(s, job_id)
    s.flush()
    s.refresh(job, with_for_update=True)
    return job


def runners(meta: dict[str, Any] | None) -> list[str]:
    """The `specbatch run` processes a job's ``meta`` says run it (``set_runner``)."""
    return list((meta or {}).get(RUNNER) or [])


def run_gone(s: Session, job: Job, gone: Callable[[str], bool]) -> list[str]:
    """The `specbatch run` processes of ``job`` that ``gone(worker)`` says have exited, where no
    live one decodes it: the holders of its running rows (expired leases too: no worker's sweep
    takes a run job's rows back, so a run killed more than a lease ago holds them on its dead name
    until `run --resume`), or, where no row is running, its runs recorded by ``set_runner`` when
    every one of them is gone (one on another machine is not known to be)."""
    held = _held_by_gone(s, job.id, gone)
    if held:
        return sorted(held)
    names = runners(job.meta)
    return names if names and all(gone(n) for n in names) and not running_ids(s, job.id) else []


def run_stopped(s: Session, job: Job, gone: Callable[[str], bool]) -> str | None:
    """How an unfinished `specbatch run` job that no process decodes stopped: "interrupted"
    (Ctrl-C), or "killed" where its run is gone (``run_gone``); None for any other job (a
    worker's, a finished one, one a run still decodes or loads the models of)."""
    if not run_in_its_process(job.meta) or JobStatus(job.status).finished:
        return None
    if job_dict(job)["status"] == "interrupted":
        return "interrupted"
    return "killed" if run_gone(s, job, gone) else None


def stopped_runs(s: Session, source: str, gone: Callable[[str], bool]) -> list[tuple[str, int, str]]:
    """The `specbatch run` jobs of the prompt file ``source`` that stopped unfinished
    (``run_stopped``): (job id, requests left, how it stopped), oldest first."""
    jobs = s.scalars(select(Job).where(Job.source == source, Job.status.in_(
        [JobStatus.queued, JobStatus.running])).order_by(Job.created_at)).all()
    stopped = [(job, how) for job in jobs if (how := run_stopped(s, job, gone)) is not None]
    counts = request_counts(s, [job.id for job, _ in stopped])
    return [(job.id, counts[job.id]["pending"] + counts[job.id]["running"], how) for job, how in stopped]


def request_counts(s: Session, job_ids: Iterable[str]) -> dict[str, dict[str, int]]:
    """Live counts from the rows, per job: {job_id: {total, pending, running, completed, ...}}."""
    ids = list(job_ids)
    out = {j: dict.fromkeys(COUNT_NAMES, 0) for j in ids}
    if not ids:
        return out
    rows = s.execute(COUNTS, {"ids": ids})
    for job_id, status, n in rows:
        out[job_id][RequestStatus(status).value] += n
        out[job_id]["total"] += n
    return out


def refresh_job(s: Session, job_id: str) -> Job:
    """Recount the job's requests and move it to the status they imply, stamping the transition."""
    job = get_job(s, job_id)
    now = utcnow()
    if job.status == JobStatus.cancelling:
        # a request whose worker died cannot finish; it would hold the cancel open forever
        s.execute(update(Request).where(Request.job_id == job.id, Request.status == RequestStatus.running,
                                        _lease_expired(now))
                  .values(status=RequestStatus.cancelled, finished_at=now, lease_expires_at=None))
    counts = request_counts(s, [job.id])[job.id]
    for name in COUNT_NAMES:
        setattr(job, name, counts[name])
    done = counts["completed"] + counts["failed"] + counts["cancelled"]
    if job.status == JobStatus.cancelling:
        if counts["running"] == 0:
            job.status, job.cancelled_at = JobStatus.cancelled, now
    elif job.status != JobStatus.cancelled:
        if done == counts["total"]:
            if counts["failed"] == 0 and counts["cancelled"] == 0:
                status = JobStatus.completed
            elif counts["completed"] == 0:
                status = JobStatus.failed
            else:
                status = JobStatus.completed_with_errors
            if job.status != status or job.finished_at is None:
                job.finished_at = now
            job.status = status
        elif counts["running"] or done or job.started_at is not None:
            job.status, job.finished_at = JobStatus.running, None
            job.started_at = job.started_at or now
        else:
            job.status = JobStatus.queued
    s.flush()
    return job


def cancel_job(s: Session, job_id: str) -> Job:
    """Stop pending work, keep finished results. Running requests finish (or are released) first:
    the job is ``cancelling`` until none is left running, then ``cancelled``. A finished job is
    returned unchanged."""
    job = get_job(s, job_id)
    if job.status.finished:
        return job
    now = utcnow()
    # requests before the job row: the same lock order as claim_requests
    s.execute(update(Request).where(Request.job_id == job.id, or_(
        Request.status == RequestStatus.pending,
        (Request.status == RequestStatus.running) & _lease_expired(now)))
        .values(status=RequestStatus.cancelled, finished_at=now, lease_expires_at=None))
    job.status, job.cancel_requested_at = JobStatus.cancelling, now
    return refresh_job(s, job.id)

def _held_by_gone(s: Session, job_id: str, gone: Callable[[str], bool], *where: Any) -> dict[str, list[int]]:
    """The job's running requests (and ``where``) whose holder ``gone(worker)`` says has exited:
    {holder: request ids}."""
    held: dict[str, list[int]] = {}
    for rid, worker in s.execute(select(Request.id, Request.worker).where(
            Request.job_id == job_id, Request.status == RequestStatus.running, *where)).all():
        if worker and gone(worker):
            held.setdefault(worker, []).append(rid)
    return held


def drop_orphans(s: Session, job_id: str, gone: Callable[[str], bool]) -> list[int]:
    """For a cancelling job: cancel the running requests whose holder ``gone(worker)`` says has
    exited (SIGKILL, a lost machine) instead of waiting for their lease to run out, then refresh
    the job (it ends ``cancelled`` when nothing else runs). Returns the ids dropped."""
    job = get_job(s, job_id)
    if job.status != JobStatus.cancelling:
        return []
    ids = [rid for rids in _held_by_gone(s, job.id, gone).values() for rid in rids]
    if ids:
        s.execute(update(Request).where(Request.id.in_(ids), Request.status == RequestStatus.running)
                  .values(status=RequestStatus.cancelled, finished_at=utcnow(), lease_expires_at=None))
        refresh_job(s, job.id)
    return ids


def held_by_gone(s: Session, job_id: str, gone: Callable[[str], bool],
                 now: datetime | None = None) -> dict[str, list[int]]:
    """The job's running requests on a live lease whose holder ``gone(worker)`` says has exited:
    {holder: request ids}. Reads only (``status`` shows them; ``expire_gone_leases`` ends them)."""
    return _held_by_gone(s, job_id, gone, Request.lease_expires_at > (now or utcnow()))



def expire_gone_leases(s: Session, job_id: str, gone: Callable[[str], bool]) -> dict[str, list[int]]:
    """End now the live leases on the job's running requests whose holder ``gone(worker)`` says has
    exited (``worker.pids.gone_here``, as ``drop_orphans``): they are claimable at once, as when
    their lease runs out (the attempt of one that began decoding stays charged: it may be what
    killed its worker). Returns {holder: request ids}."""
    now = utcnow()
    held = held_by_gone(s, job_id, gone, now)
    ids = [rid for rids in held.values() for rid in rids]
    if ids:
        s.execute(update(Request).where(Request.id.in_(ids), Request.status == RequestStatus.running)
                  .values(lease_expires_at=now))
        s.flush()
    return held


def running_ids(s: Session, job_id: str) -> list[int]:
    """The job's requests a worker holds now (running on a live lease)."""
    return list(s.scalars(select(Request.id).where(Request.job_id == job_id, Request.status == RequestStatus.running)))


def statuses_of(s: Session, request_ids: Sequence[int]) -> dict[str, int]:
    """{status: how many of ``request_ids``}."""
    if not request_ids:
        return {}
    return {RequestStatus(st).value: int(n) for st, n in s.execute(
        select(Request.status, func.count()).where(Request.id.in_(list(request_ids))).group_by(Request.status))}


def retry_failed(s: Session, job_id: str) -> list[int]:
    """Failed requests back to pending (attempts reset); returns their ids, for enqueueing."""
    job = get_job(s, job_id)
    if job.status in STOPPING_JOB:
        raise SpecBatchError(f"job {job.id} is {job.status.value}; a cancelled job cannot be retried "
                             "(submit the file again)")
    ids = list(s.scalars(select(Request.id).where(Request.job_id == job.id,
                                                  Request.status == RequestStatus.failed)
                         .order_by(Request.id)))
    if ids:
        s.execute(update(Request).where(Request.id.in_(ids), Request.status == RequestStatus.failed)
                  .values(status=RequestStatus.pending, attempts=0, error=None, error_type=None,
                          error_param=None, worker=None,
                          lease_expires_at=None, started_at=None, finished_at=None))
    refresh_job(s, job.id)
    return ids


def resumable_request_ids(s: Session, job_id: str) -> list[int]:
    """Requests no live task holds: pending, or running with an expired lease (worker gone)."""
    job = get_job(s, job_id)
    if job.status in STOPPING_JOB:
        return []
    now = utcnow()
    return list(s.scalars(select(Request.id).where(Request.job_id == job.id, or_(
        Request.status == RequestStatus.pending,
        (Request.status == RequestStatus.running) & _lease_expired(now))).order_by(Request.id)))


def expired_leases(s: Session, job_id: str) -> int:
    """How many of the job's requests are running on a lease that has expired (their worker died);
    a live worker of their queue queues them again (``specbatch.worker.heal``)."""
    now = utcnow()
    return int(s.scalar(select(func.count()).select_from(Request).where(
        Request.job_id == job_id, Request.status == RequestStatus.running,
        Request.lease_expires_at.is_not(None), Request.lease_expires_at <= now)) or 0)


Route = tuple[str, tuple[str, ...]]     # (target, drafts): the models a request runs on


def request_routes(s: Session, job_id: str, request_ids: Sequence[int] | None = None, *,
                   by_prefix: bool = False) -> dict[Route | None, list[int]]:
    """The job's requests (or ``request_ids`` of them) grouped by the pair they run on: None for the
    job's own pair (its ``queue``), else the (target, drafts) --model-map routed their body.model
    to. Ids ascending within a route; ``by_prefix``: in chunking order instead, requests sharing a
    prompt prefix adjacent (jobs/prefix_order.py)."""
    job = get_job(s, job_id)
    stmt = select(Request.id, Request.target, Request.drafts).where(Request.job_id == job.id)
    if request_ids is not None:
        stmt = stmt.where(Request.id.in_(list(request_ids)))
    out: dict[Route | None, list[int]] = {}
    for rid, target, drafts in s.execute(stmt.order_by(Request.id)):
        out.setdefault(None if target is None else (target, tuple(drafts or ())), []).append(rid)
    if by_prefix:
        out = {route: prefix_ordered(s, ids) for route, ids in out.items()}
    return out


# ---------------------------------------------------------------- requests (the worker's side)


def _lease_expired(now: datetime) -> Any:
    return or_(Request.lease_expires_at.is_(None), Request.lease_expires_at <= now)


def claim_requests(s: Session, request_ids: Sequence[int], worker: str, lease_seconds: int,
                   max_attempts: int) -> list[ClaimedRequest]:
    """Take a lease on the claimable requests among ``request_ids`` (see docs/CONTRACTS.md).

    Claimable: pending, or running with an expired lease. A request that already used
    ``max_attempts`` is failed instead; requests of a cancelled job become cancelled. The claim
    charges no attempt: ``start_requests`` does, when decoding begins, so requests a worker held
    queued behind its batch are not blamed if it dies (``ClaimedRequest.attempts``: decodes begun
    before, none finished).
    """
    if not request_ids:
        return []
    now = utcnow()
    # PostgreSQL: rows another claimer holds are skipped (it will take them); SQLite: BEGIN IMMEDIATE
    rows = s.scalars(select(Request).where(Request.id.in_(list(request_ids))).order_by(Request.id)
                     .with_for_update(skip_locked=True)).all()
    job_ids = {r.job_id for r in rows}
    job_status = {j: JobStatus(st) for j, st in s.execute(select(Job.id, Job.status)
                                                          .where(Job.id.in_(job_ids)))}
    claimed: list[ClaimedRequest] = []
    for r in rows:
        expired = r.lease_expires_at is None or r.lease_expires_at <= now
        if not (r.status == RequestStatus.pending or (r.status == RequestStatus.running and expired)):
            continue                      # finished, or another worker holds a live lease
        if job_status[r.job_id] in STOPPING_JOB:
            r.status, r.finished_at, r.lease_expires_at = RequestStatus.cancelled, now, None
            continue
        if r.attempts >= max_attempts:
            r.status, r.finished_at, r.lease_expires_at = RequestStatus.failed, now, None
            # (a worker or a `specbatch run`: the last one is named, as `status` names holders)
            r.error = f"attempted {plural(r.attempts, 'time')}, the process decoding it died each time" + \
                (f" (last: {r.worker})" if r.worker else "")
            r.error_type, r.error_param = SERVER_ERROR, None
            continue
        r.status, r.worker, r.started_at = RequestStatus.running, worker, None
        r.lease_expires_at = now + timedelta(seconds=lease_seconds)
        claimed.append(ClaimedRequest(id=r.id, job_id=r.job_id, custom_id=r.custom_id, prompt=r.prompt,
                                      messages=r.messages, params=params_from_dict(r.params),
                                      attempts=r.attempts, input_ids=r.prompt_ids))
    started = {c.job_id for c in claimed}
    if started:       # a job starts with its first claimed request
        s.execute(update(Job).where(Job.id.in_(started), Job.status == JobStatus.queued)
                  .values(status=JobStatus.running, started_at=now))
    s.flush()
    return claimed


def start_requests(s: Session, request_ids: Sequence[int], worker: str) -> None:
    """Decoding of the claimed ``request_ids`` begins: each is charged an attempt (a worker that
    dies now is blamed on them: after ``max_attempts`` the claim fails them) and its latency
    starts."""
    if not request_ids:
        return
    s.execute(update(Request).where(Request.id.in_(list(request_ids)), Request.worker == worker,
                                    Request.status == RequestStatus.running)
              .values(attempts=Request.attempts + 1, started_at=utcnow()))
    s.flush()


def renew_leases(s: Session, request_ids: Sequence[int], worker: str, lease_seconds: int) -> None:
    """Extend the leases this worker holds (call while a long chunk is generating)."""
    if not request_ids:
        return
    s.execute(update(Request).where(Request.id.in_(list(request_ids)), Request.worker == worker,
                                    Request.status == RequestStatus.running)
              .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds)))
    s.flush()


def release_requests(s: Session, request_ids: Sequence[int]) -> None:
    """Give back claimed requests (the worker stops: Ctrl-C, an outage): running -> pending, the
    attempt of those that began decoding undone (not their fault). Requests of a cancelled job
    become cancelled instead."""
    if not request_ids:
        return
    ids = list(request_ids)
    stopping = select(Job.id).where(Job.status.in_(STOPPING_JOB))
    base = update(Request).where(Request.id.in_(ids), Request.status == RequestStatus.running)
    s.execute(base.where(Request.job_id.in_(stopping))
              .values(status=RequestStatus.cancelled, finished_at=utcnow(), lease_expires_at=None))
    s.execute(base.values(status=RequestStatus.pending, lease_expires_at=None, worker=None,
                          started_at=None,
                          attempts=case((Request.started_at.is_not(None) & (Request.attempts > 0),
                                         Request.attempts - 1), else_=Request.attempts)))
    s.flush()


def leased_requests(s: Session, job_id: str) -> list[tuple[int, str, datetime]]:
    """(id, worker, lease end) of the job's running requests whose lease is still live."""
    now = utcnow()
    rows = s.execute(select(Request.id, Request.worker, Request.lease_expires_at).where(
        Request.job_id == job_id, Request.status == RequestStatus.running,
        Request.lease_expires_at > now).order_by(Request.id))
    return [(rid, worker or "?", lease) for rid, worker, lease in rows if lease is not None]


def release_held_by(s: Session, job_id: str, worker: str) -> list[int]:
    """Release (see ``release_requests``) the job's requests ``worker`` holds; returns their ids."""
    ids = list(s.scalars(select(Request.id).where(Request.job_id == job_id, Request.worker == worker,
                                                  Request.status == RequestStatus.running)))
    release_requests(s, ids)
    return ids


def set_interrupted(s: Session, job_id: str, interrupted: bool) -> None:
    """Mark (or unmark) the job as interrupted: a ``specbatch run`` stopped before its end.
    Kept in the job's metadata; ``job_dict`` shows such an unfinished job as ``interrupted``."""
    job = _locked_job(s, job_id)
    meta = dict(job.meta or {})
    if interrupted:
        meta["interrupted_at"] = utcnow().isoformat()
    elif meta.pop("interrupted_at", None) is None:
        return
    job.meta = meta
    s.flush()


def _table(model: Any) -> Table:
    """A mapped class's Table (``__table__`` is typed as any FromClause)."""
    return model.__table__


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


def _insert_ignoring_duplicates(s: Session, values: dict[str, Any]) -> bool:
    """INSERT ... ON CONFLICT (request_id, sample_index) DO NOTHING; True if a row was written."""
    dialect = s.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        from sqlalchemy.dialects import postgresql, sqlite

        insert: Any = sqlite.insert if dialect == "sqlite" else postgresql.insert
        stmt = (insert(Result).values(**values).on_conflict_do_nothing(index_elements=["request_id", "sample_index"])
                .returning(Result.id))
        return s.execute(stmt).first() is not None
    try:                                              # any other backend: a savepoint
        with s.begin_nested():
            s.execute(_table(Result).insert().values(**values))
        return True
    except IntegrityError:
        return False


def record_result(s: Session, request_id: int, output: GenerationOutput, worker: str,
                  models: dict[str, Any] | None = None, *, cache_key: str | None = None,
                  cache_target: str | None = None) -> bool:
    """Store a request's output (one row per sample: ``output.samples``) and mark it completed.
    Idempotent: False if a result existed (the stored one is kept, the request still ends
    completed). ``models``: the ``target``,
    ``drafts`` and ``lossy`` flag of the engine that produced it (recorded with the result).
    ``cache_key``/``cache_target``: the results cache's key and target fingerprint
    (jobs.result_cache), for deterministic requests."""
    req = s.get(Request, request_id)
    if req is None:
        logger.warning("result for request %s dropped: no such request (job deleted?)", request_id)
        return False
    now = utcnow()
    started = req.started_at if req.started_at is not None and req.started_at <= now else None
    written = False
    for sample in output.samples:
        values = _result_values(req, sample, worker, models, started, now)
        values.update(cache_key=cache_key, cache_target=cache_target)
        written = _insert_ignoring_duplicates(s, values) or written
    _complete(s, req, now)
    return written


def _result_values(req: Request, output: GenerationOutput, worker: str, models: dict[str, Any] | None,
                   started: datetime | None, now: datetime) -> dict[str, Any]:
    """One results row: a sample of the request's output."""
    st = output.stats
    latency = (now - started).total_seconds() if started else _finite(st.wall_seconds)
    return {
        "request_id": req.id, "sample_index": int(output.sample_index), "job_id": req.job_id, "text": output.text.replace("\x00", "\ufffd"),  # PostgreSQL text cannot hold NUL
        "token_ids": [int(t) for t in output.token_ids], "prompt_tokens": int(st.prompt_tokens),
        "cached_prompt_tokens": int(st.cached_prompt_tokens),
        "prefill_seconds_saved": _finite(st.prefill_seconds_saved),
        "completion_tokens": len(output.token_ids), "finish_reason": output.finish_reason,
        "verify_steps": st.verify_steps, "drafted_tokens": st.drafted_tokens,
        "accepted_tokens": st.accepted_tokens, "acceptance_rate": _finite(st.acceptance_rate),
        "mean_acceptance_length": _finite(st.mean_acceptance_length),
        "accepted_per_position": [_finite(x) for x in st.accepted_per_position],
        "draft_steps": int(st.draft_steps),
        "accepted_at_position": [int(x) for x in st.accepted_at_position],
        "target_forwards": st.target_forwards, "draft_forwards": st.draft_forwards,
        "draft_seconds": _finite(st.draft_seconds), "verify_seconds": _finite(st.verify_seconds),
        "wall_seconds": _finite(st.wall_seconds), "tokens_per_second": _finite(st.tokens_per_second),
        "pool_wins": {str(k): int(v) for k, v in st.pool_wins.items()}, "final_gamma": st.final_gamma,
        "speculation_disabled": bool(st.speculation_disabled), "worker": worker,
        "grammar_drafted_tokens": int(st.grammar_drafted_tokens),
        "grammar_accepted_tokens": int(st.grammar_accepted_tokens),
        "batch_size_seconds": {str(k): _finite(v) for k, v in st.batch_size_seconds.items()},
        "started_at": started, "finished_at": now, "latency_seconds": latency,
        "target": (models or {}).get("target"), "drafts": (models or {}).get("drafts"),
        "lossy": bool((models or {}).get("lossy", False)), "numerics": (models or {}).get("numerics"),
        "logprobs": None if output.logprobs is None else logprobs.pack(output.logprobs),
    }


def _complete(s: Session, req: Request, now: datetime) -> None:
    if req.status != RequestStatus.completed:
        req.status, req.finished_at, req.lease_expires_at, req.error = (
            RequestStatus.completed, now, None, None)
        req.error_type = req.error_param = None
    s.flush()


def record_cached_result(s: Session, request_id: int, source: Result, worker: str) -> bool:
    """Complete a request with a copy of the result ``source`` (a results-cache hit): the same text
    and tokens (and the models that produced them), marked ``cached``, referring to the generated
    row, with zero generation statistics (docs/statistics.md, "Results-cache hits": no prompt token
    read from the prefix cache either, 0 not NULL, which marks a row older than the column);
    ``started_at`` = ``finished_at`` = when the copy is written. Idempotent like record_result."""
    req = s.get(Request, request_id)
    if req is None:
        return False
    now = utcnow()
    # a hit is served before any decoding, so the request never started: the copy starts and ends
    # at the moment it is written (latency 0), leaving no NULL start in the exports and the view
    started = req.started_at if req.started_at is not None and req.started_at <= now else now
    values = {
        "request_id": req.id, "job_id": req.job_id, "text": source.text, "token_ids": list(source.token_ids),
        "prompt_tokens": source.prompt_tokens, "completion_tokens": source.completion_tokens,
        "cached_prompt_tokens": 0, "prefill_seconds_saved": 0.0,
        "finish_reason": source.finish_reason, "worker": worker, "started_at": started, "finished_at": now,
        "latency_seconds": (now - started).total_seconds(),
        "accepted_per_position": [], "pool_wins": {}, "target": source.target, "drafts": source.drafts,
        "lossy": source.lossy, "numerics": source.numerics,     # decoded where the source was
        "cache_key": source.cache_key, "cache_target": source.cache_target, "cached": True,
        "cached_from": source.cached_from if source.cached else source.id,  # the generated row
        "logprobs": source.logprobs,    # the key holds the request's logprobs: the source's are the same
    }
    written = _insert_ignoring_duplicates(s, values)
    _complete(s, req, now)
    return written


def record_failure(s: Session, request_id: int, error: str, worker: str, *,
                   error_type: str = INVALID_REQUEST, param: str | None = None) -> None:
    """The request failed for ``error``: its own fault (``error_type`` INVALID_REQUEST, ``param`` the
    field at fault) or the worker's side (SERVER_ERROR). A completed request stays completed."""
    req = s.get(Request, request_id)
    if req is None or req.status == RequestStatus.completed:
        return
    req.status, req.error, req.worker = RequestStatus.failed, error, worker
    req.error_type, req.error_param = error_type, param
    req.finished_at, req.lease_expires_at = utcnow(), None
    s.flush()


# ---------------------------------------------------------------- reporting


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def job_dict(job: Job, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """The job's columns as JSON-ready data (``request_counts`` from ``counts`` if given)."""
    status = JobStatus(job.status).value
    if (job.meta or {}).get("interrupted_at") and not JobStatus(job.status).finished \
            and job.status != JobStatus.cancelling:
        status = "interrupted"   # a `specbatch run` stopped early; `specbatch run --resume` ends it
    return {
        "id": job.id, "status": status, "target": job.target,
        **pool_fields(job.drafts or []), "queue": job.queue,
        "params": dict(job.params or {}), "source": job.source, "metadata": dict(job.meta or {}),
        "created_at": _iso(job.created_at), "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at), "cancel_requested_at": _iso(job.cancel_requested_at),
        "cancelled_at": _iso(job.cancelled_at), "updated_at": _iso(job.updated_at),
        "request_counts": counts if counts is not None else {n: getattr(job, n) for n in COUNT_NAMES},
    }


def job_summary(s: Session, job_id: str) -> dict[str, Any]:
    """The ``status --json`` object: the job, live request counts and its statistics."""
    from specbatch.jobs.stats import job_stats

    job = get_job(s, job_id)
    out = job_dict(job, request_counts(s, [job.id])[job.id])
    out["models"] = model_routes(s, job)
    out["stats"] = job_stats(s, job.id)
    out["failures"] = failures(s, job.id)
    return out


SHOWN_FAILURES = 5


def failures(s: Session, job_id: str, limit: int = SHOWN_FAILURES) -> list[dict[str, Any]]:
    """The job's first failed requests by line, {line_no, custom_id, error}: why a job exited 3 must
    show where the user looks (the run summary, status), not only in an export."""
    q = (select(Request.line_no, Request.custom_id, Request.error)
         .where(Request.job_id == job_id, Request.status == RequestStatus.failed)
         .order_by(Request.line_no).limit(limit))
    return [{"line_no": n, "custom_id": c, "error": e} for n, c, e in s.execute(q)]


def token_budgets(s: Session, job_id: str, request_ids: Sequence[int] | None = None) -> list[int]:
    """The ``max_new_tokens`` of a job's requests (all, or these): what auto compile weighs
    compiling by (``Engine.load``)."""
    q = select(Request.params).where(Request.job_id == job_id)
    if request_ids is not None:
        q = q.where(Request.id.in_(list(request_ids)))
    return [int((p or {}).get("max_new_tokens") or 0) for p in s.execute(q).scalars()]


def model_routes(s: Session, job: Job) -> list[dict[str, Any]]:
    """Per body.model of the job's requests (None: lines without one), where it runs: {model, target,
    drafts, drafters, requests}; the job's pair unless --model-map routed the model (one route per
    model). ``drafts``: the draft models; ``drafters``: every drafter, those of the job's pool that
    load no model (--ngram) too, which draft on every route."""
    pool = parse_drafters(job.drafts or [])
    out = []
    counts = s.execute(select(Request.model, func.count()).where(Request.job_id == job.id)
                       .group_by(Request.model)).all()
    for model, n in sorted(counts, key=lambda r: (r[0] is not None, r[0] or "")):   # NULL first everywhere
        same = Request.model.is_(None) if model is None else Request.model == model
        target, drafts = s.execute(select(Request.target, Request.drafts)
                                   .where(Request.job_id == job.id, same).limit(1)).one()
        own = list(drafts or []) if target else model_names(pool)
        out.append({"model": model, "target": target or job.target, "drafts": own,
                    "drafters": own + names(without_models(pool)), "requests": n})
    return out
