"""Leases that heal on their own: every live worker sweeps the requests of the queues it consumes
whose lease expired (their worker died: SIGKILL, machine lost) and queues them again, exactly once.

Without it a dead worker's requests stay ``running`` until Redis redelivers its unacked message,
``visibility_timeout`` later (an hour by default), or someone runs ``specbatch resume``.

Exactly once: the sweep turns the requests back to ``pending`` in one UPDATE that re-checks
"running with an expired lease" row by row, so of two workers sweeping at once each request goes
to one of them (PostgreSQL re-evaluates the condition on a row another transaction changed;
SQLite's write lock serializes the two), and only the winner enqueues it. A request enqueued
twice anyway (the dead worker's message redelivered later) is still generated once: claims skip
what is finished.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Any

from sqlalchemy import select, update

from specbatch.config import Settings
from specbatch.jobs.store import run_in_its_process
from specbatch.redact import mask

logger = logging.getLogger(__name__)


def take_back_expired(s: Any, queues: Collection[str]) -> dict[tuple[str, str], list[int]]:
    """Turn the running requests of ``queues`` whose lease expired back to pending, in the caller's
    transaction; returns {(job id, queue): request ids} of those this call took. A ``specbatch run``
    job's are left alone: no worker decodes them (its ``resume`` takes them back)."""
    from specbatch.db.models import Job, JobStatus, Request, RequestStatus, utcnow
    from specbatch.worker.queues import route_queue

    now = utcnow()
    expired = (Request.status == RequestStatus.running) & Request.lease_expires_at.is_not(None) & \
        (Request.lease_expires_at <= now)
    rows = s.execute(select(Request.id, Request.job_id, Request.target, Request.drafts, Job.queue, Job.drafts,
                            Job.meta)
                     .join(Job, Job.id == Request.job_id)
                     .where(expired, Job.status.in_([JobStatus.queued, JobStatus.running]))).all()
    mine: dict[int, tuple[str, str]] = {}
    for rid, job_id, target, drafts, job_queue, job_drafters, meta in rows:
        if run_in_its_process(meta):
            continue
        queue = route_queue(None if target is None else (target, drafts or []), job_queue, job_drafters or [])
        if queue in queues:
            mine[rid] = (job_id, queue)
    if not mine:
        return {}
    # ``worker`` stays: the last holder, named if the request runs out of attempts
    taken = s.scalars(update(Request).where(Request.id.in_(list(mine)), expired)
                      .values(status=RequestStatus.pending, lease_expires_at=None)
                      .returning(Request.id)).all()
    out: dict[tuple[str, str], list[int]] = {}
    for rid in sorted(taken):
        out.setdefault(mine[rid], []).append(rid)
    return out


def end_cancelling(s: Any) -> list[str]:
    """Cancelling jobs that still wait for a request whose lease expired (its worker died, here or
    elsewhere): that request is cancelled and the job refreshed, so it ends ``cancelled`` with no
    human action (``cancel`` drops at once only the requests of a worker killed on its own
    machine). Any live worker does it; returns the jobs refreshed."""
    from specbatch.db.models import Job, JobStatus, Request, RequestStatus, utcnow
    from specbatch.jobs import store

    now = utcnow()
    stale = select(Request.job_id).where(Request.status == RequestStatus.running,
                                         Request.lease_expires_at.is_not(None), Request.lease_expires_at <= now)
    jobs = list(s.scalars(select(Job.id).where(Job.status == JobStatus.cancelling, Job.id.in_(stale))))
    for job_id in jobs:
        store.refresh_job(s, job_id)    # cancels a cancelling job's running requests past their lease
    return jobs


def sweep(settings: Settings, queues: Collection[str]) -> int:
    """One sweep: take back the expired requests of ``queues`` and enqueue them; returns how many.
    Cancelling jobs held up by a dead worker's lease are ended (``end_cancelling``)."""
    from specbatch.db import session_factory
    from specbatch.worker.enqueue import enqueue_requests

    with session_factory(settings.database_url).begin() as s:
        taken = take_back_expired(s, queues)
        for job_id in end_cancelling(s):
            logger.warning("job %s: cancelled requests whose worker died (lease expired) dropped", job_id)
    for (job_id, queue), ids in taken.items():
        # (if this send fails the requests stay pending: `specbatch resume` sends them)
        enqueue_requests(settings, job_id, ids, queue)
        logger.warning("job %s: %d request(s) whose worker died (lease expired) queued again on %s",
                       job_id, len(ids), queue)
    return sum(len(ids) for ids in taken.values())


class Sweeper:
    """A daemon thread that sweeps ``queues`` at once and then every ``settings.lease_sweep_seconds``:
    expired leases, and requests queued in the database with no task in the broker
    (``stranded.Requeuer``)."""

    def __init__(self, settings: Settings, queues: Collection[str]) -> None:
        from specbatch.worker.stranded import Requeuer

        self.settings, self.queues = settings, tuple(queues)
        self.requeuer = Requeuer(settings, self.queues)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specbatch-lease-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                sweep(self.settings, self.queues)
                self.requeuer.sweep()
            except Exception as e:     # the database or broker is down: the breaker handles that; try later
                logger.warning("lease sweep failed, trying again in %ss: %s", self.settings.lease_sweep_seconds,
                               mask(str(e).splitlines()[0] if str(e) else type(e).__name__))
            self._stop.wait(self.settings.lease_sweep_seconds)
