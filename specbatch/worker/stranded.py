"""Requests queued in the database with no task in the broker: the broker lost its tasks (a flush,
Redis restarted without its append-only file). Nothing would ever run them; each live worker
looks for them in its queues on the lease sweeper's timer (``heal.Sweeper``) and queues them
again, once.

A request is stranded when it is ``pending`` in a job that is neither stopping nor run in-process
(``specbatch run``), was created over ``lease_sweep_seconds`` ago (``submit`` writes rows before it
sends their tasks), its queue has no waiting task at all, and no task a worker took (Redis keeps
those, unacked, in one hash) names it. Two guards keep the re-enqueue to one:

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

logger = logging.getLogger(__name__)

KOMBU_PRIORITY_SEP = "\x06\x16"     # kombu's Redis transport keeps priority p > 0 in "queue\x06\x16p"
KOMBU_PRIORITIES = (3, 6, 9)
UNACKED_KEY = "unacked"             # kombu's Redis transport: delivered, not yet acknowledged messages
BROKER_TIMEOUT = 2.0


def queue_keys(queue: str) -> tuple[str, ...]:
    return (queue, *(f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITIES))


def _request_ids(payload: Any) -> tuple[str, list[int]] | None:
    """(job id, request ids) of one of our task messages (Celery protocol 2, JSON); None otherwise."""
    try:
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0]), [int(i) for i in args[1]]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def broker_holds(settings: Settings, queue: str) -> set[int] | None:
    """The request ids of ``queue``'s tasks that workers took and have not acknowledged, when the
    queue has no waiting task; None when it has some, or the broker cannot be looked into."""
    if not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    client = redis.Redis.from_url(settings.broker_url, socket_timeout=BROKER_TIMEOUT,
                                  socket_connect_timeout=BROKER_TIMEOUT)
    try:
        with client.pipeline(transaction=False) as pipe:
            for key in queue_keys(queue):
                pipe.llen(key)
            pipe.hvals(UNACKED_KEY)         # a few per worker (prefetch 1): small
            *lengths, unacked = pipe.execute()
    finally:
        client.close()
    if any(lengths):
        return None
    held: set[int] = set()
    for raw in unacked:
        try:
            payload, _exchange, routing_key = json.loads(raw)
        except (TypeError, ValueError):
            continue
        ids = _request_ids(payload) if routing_key == queue else None
        if ids is not None:
            held.update(ids[1])
    return held


def pending_in(s: Any, queues: Collection[str], older_than: timedelta, job_id: str | None = None
               ) -> dict[int, tuple[str, str]]:
    """{request id: (job id, queue)} of the pending requests of ``queues`` (of ``job_id`` only, when
    given) created over ``older_than`` ago, not marked as sent within it, in jobs that run on the
    queue (not stopping, not in-process)."""
    from specbatch.db.models import Job, JobStatus, Request, RequestStatus, utcnow
    from specbatch.worker.queues import route_queue

    now = utcnow()
    stmt = (select(Request.id, Request.job_id, Request.target, Request.drafts, Job.queue, Job.drafts, Job.meta)
            .join(Job, Job.id == Request.job_id)
            .where(Request.status == RequestStatus.pending, Request.created_at <= now - older_than,
                   or_(Request.lease_expires_at.is_(None), Request.lease_expires_at <= now),
                   Job.status.in_([JobStatus.queued, JobStatus.running])))
    if job_id is not None:
        stmt = stmt.where(Request.job_id == job_id)
    out: dict[int, tuple[str, str]] = {}
    for rid, jid, target, drafts, job_queue, job_drafters, meta in s.execute(stmt):
        if (meta or {}).get("embedded"):
            continue            # `specbatch run` holds it in its own process: no broker involved
        queue = route_queue(None if target is None else (target, list(drafts or [])), job_queue,
                            list(job_drafters or []))
        if queue in queues:
            out[rid] = (jid, queue)
    return out


def without_task(settings: Settings, s: Any, queues: Collection[str], job_id: str | None = None
                 ) -> dict[int, tuple[str, str]]:
    """The stranded requests of ``queues`` as ``pending_in`` gives them. The broker is asked first:
    a queue with waiting tasks (the usual case) costs no database read."""
    held = {q: broker_holds(settings, q) for q in queues}
    empty = [q for q, ids in held.items() if ids is not None]
    if not empty:
        return {}
    candidates = pending_in(s, empty, timedelta(seconds=settings.lease_sweep_seconds), job_id)
    return {rid: v for rid, v in candidates.items() if rid not in (held[v[1]] or ())}


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
