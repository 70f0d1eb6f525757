"""Requests queued in the database with no task in the broker: the broker lost its tasks (a flush,
Redis restarted without its append-only file). Nothing would ever run them; each live worker
looks for them in its queues on the lease sweeper's timer (``heal.Sweeper``) and queues them
again, once.

A request is stranded when it is ``pending`` in a job that is neither stopping nor run in-process
(``specbatch run``), was created over ``lease_sweep_seconds`` ago (``submit`` writes rows before it
sends their tasks), and no task of its queue names it: neither one waiting in the queue nor one a
worker took (Redis keeps those, unacked, in one hash). Tasks submitted after the loss keep the
queue busy, so the queue's tasks are read, not just counted: a Redis restart followed by new
submissions strands the old job's requests behind the new job's tasks. A queue longer than
``MAX_SCAN`` tasks is not read (nothing is concluded until it drains below). A look reads the
candidates' ids, and whole rows only for ids no task names (usually none).

Two guards keep the re-enqueue to one:

- a request must be found stranded on two sweeps in a row: a task between the queue and the
  unacked hash (kombu moves it in two steps) is not mistaken for a lost one;
- the worker that queues it first marks it (``lease_expires_at`` on a pending row: "sent, give it
  ``lease_sweep_seconds``") in one UPDATE that re-checks the mark, so of two workers sweeping at
  once only one sends it. A claim overwrites the mark; nothing else reads it on a pending row.

Only Redis brokers can be looked into; with another broker nothing is concluded.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Collection
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update

from specbatch.config import Settings
from specbatch.jobs.store import run_in_its_process

logger = logging.getLogger(__name__)

KOMBU_PRIORITY_SEP = "\x06\x16"     # kombu's Redis transport keeps priority p > 0 in "queue\x06\x16p"
KOMBU_PRIORITIES = (3, 6, 9)
UNACKED_KEY = "unacked"             # kombu's Redis transport: delivered, not yet acknowledged messages
BROKER_TIMEOUT = 2.0
MAX_SCAN = 20_000                   # waiting tasks read from one queue per look (a few MB of JSON)
MAX_IN = 1_000                      # ids given to SQL's IN (...); more are filtered here


def queue_keys(queue: str) -> tuple[str, ...]:
    return (queue, *(f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITIES))


def _request_ids(payload: Any, database: str) -> tuple[str, list[int]] | None:
    """(job id, request ids) of one of our task messages (Celery protocol 2, JSON) of the database
    whose id is ``database`` (or sent before tasks named theirs); None otherwise: another
    database's request ids say nothing of this one's rows (docs/DESIGN.md, "Tasks of another
    database")."""
    try:
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs = json.loads(body)[:2]
        if kwargs.get("database", database) != database:
            return None
        return str(args[0]), [int(i) for i in args[1]]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def broker_holds(settings: Settings, queue: str) -> set[int] | None:
    """The request ids of ``queue``'s tasks of this database in the broker: waiting in the queue,
    or taken by a worker and not acknowledged; None when the broker cannot be looked into or the queue holds
    more than ``MAX_SCAN`` tasks."""
    if not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    from specbatch.db import database_id

    database = database_id(settings.database_url)

    client = redis.Redis.from_url(settings.broker_url, socket_timeout=BROKER_TIMEOUT,
                                  socket_connect_timeout=BROKER_TIMEOUT)
    keys = queue_keys(queue)
    try:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.llen(key)
            if sum(pipe.execute()) > MAX_SCAN:
                return None
        # one snapshot of the lists and the hash: a task popped between two reads would be in neither
        with client.pipeline(transaction=True) as pipe:
            for key in keys:
                pipe.lrange(key, 0, -1)
            pipe.hvals(UNACKED_KEY)         # a few per worker (prefetch 1): small
            *waiting, unacked = pipe.execute()
    finally:
        client.close()
    held: set[int] = set()
    for raw in (m for msgs in waiting for m in msgs):
        ids = _request_ids(_json(raw), database)
        if ids is not None:
            held.update(ids[1])
    for raw in unacked:
        entry = _json(raw)
        if isinstance(entry, list) and len(entry) == 3 and entry[2] == queue:
            ids = _request_ids(entry[0], database)
            if ids is not None:
                held.update(ids[1])
    return held


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return None


def _candidates(queues: Collection[str], older_than: timedelta, job_id: str | None, *columns: Any) -> Any:
    """SELECT ``columns`` of the pending requests a look considers: created over ``older_than`` ago,
    not marked as sent within it, in jobs that run (not stopping), on ``queues`` when they run on
    their job's pair (a routed request's queue is worked out by ``pending_in``)."""
    from specbatch.db.models import Job, JobStatus, Request, RequestStatus, utcnow

    now = utcnow()
    stmt = (select(*columns).join(Job, Job.id == Request.job_id)
            .where(Request.status == RequestStatus.pending, Request.created_at <= now - older_than,
                   or_(Request.lease_expires_at.is_(None), Request.lease_expires_at <= now),
                   Job.status.in_([JobStatus.queued, JobStatus.running]),
                   or_(Request.target.is_not(None), Job.queue.in_(list(queues)))))
    return stmt if job_id is None else stmt.where(Request.job_id == job_id)


def pending_in(s: Any, queues: Collection[str], older_than: timedelta, job_id: str | None = None,
               among: Collection[int] | None = None) -> dict[int, tuple[str, str]]:
    """{request id: (job id, queue)} of the pending requests of ``queues`` (of ``job_id`` only, and
    of ``among`` only, when given) created over ``older_than`` ago, not marked as sent within it,
    in jobs that run on the queue (not stopping, not in-process)."""
    from specbatch.db.models import Job, Request
    from specbatch.worker.queues import route_queue

    stmt = _candidates(queues, older_than, job_id, Request.id, Request.job_id, Request.target,
                       Request.drafts, Job.queue, Job.drafts, Job.meta)
    if among is not None and len(among) <= MAX_IN:
        stmt = stmt.where(Request.id.in_(list(among)))
    out: dict[int, tuple[str, str]] = {}
    for rid, jid, target, drafts, job_queue, job_drafters, meta in s.execute(stmt):
        if run_in_its_process(meta) or (among is not None and rid not in among):
            continue            # `specbatch run` holds it in its own process, no broker involved
        queue = route_queue(None if target is None else (target, list(drafts or [])), job_queue,
                            list(job_drafters or []))
        if queue in queues:
            out[rid] = (jid, queue)
    return out


def without_task(settings: Settings, s: Any, queues: Collection[str], job_id: str | None = None
                 ) -> dict[int, tuple[str, str]]:
    """The stranded requests of ``queues`` as ``pending_in`` gives them. The broker is read first,
    then the candidates' ids alone; rows are read only for ids no task names (usually none)."""
    from specbatch.db.models import Request

    held = {q: ids for q in queues if (ids := broker_holds(settings, q)) is not None}
    if not held:
        return {}
    older_than = timedelta(seconds=settings.lease_sweep_seconds)
    named = set().union(*held.values())
    unnamed = set(s.scalars(_candidates(held, older_than, job_id, Request.id)).all()) - named
    if not unnamed:
        return {}
    return {rid: v for rid, v in pending_in(s, held, older_than, job_id, among=unnamed).items()
            if rid not in held[v[1]]}


def mark_sent(s: Any, request_ids: Collection[int], seconds: int) -> list[int]:
    """Mark the still-unmarked pending ``request_ids`` as sent now; returns those this call marked."""
    from specbatch.db.models import Request, RequestStatus, utcnow

    now = utcnow()
    return list(s.scalars(update(Request).where(
        Request.id.in_(list(request_ids)), Request.status == RequestStatus.pending,
        or_(Request.lease_expires_at.is_(None), Request.lease_expires_at <= now))
        .values(lease_expires_at=now + timedelta(seconds=seconds)).returning(Request.id)).all())


class Requeuer:
    """One worker's look for stranded requests on each sweep; requests found on two sweeps in a row
    are queued again (see the module's docstring)."""

    def __init__(self, settings: Settings, queues: Collection[str]) -> None:
        self.settings, self.queues = settings, tuple(queues)
        self._suspects: set[int] = set()

    def sweep(self) -> int:
        from specbatch.db import session_factory
        from specbatch.worker.enqueue import enqueue_requests

        factory = session_factory(self.settings.database_url)
        with factory.begin() as s:
            found = without_task(self.settings, s, self.queues)
        twice = {rid: v for rid, v in found.items() if rid in self._suspects}
        self._suspects = set(found) - set(twice)
        if not twice:
            return 0
        with factory.begin() as s:
            marked = mark_sent(s, list(twice), self.settings.lease_sweep_seconds)
        groups: dict[tuple[str, str], list[int]] = {}
        for rid in sorted(marked):
            groups.setdefault(twice[rid], []).append(rid)
        for (job_id, queue), ids in groups.items():
            # (if this send fails the mark lapses after lease_sweep_seconds and a later sweep sends them)
            enqueue_requests(self.settings, job_id, ids, queue)
            logger.warning("job %s: %d queued request(s) had no task in the broker (flushed or lost); "
                           "queued again on %s", job_id, len(ids), queue)
        return len(marked)
