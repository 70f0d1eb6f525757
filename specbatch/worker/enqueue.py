"""Publish a job's request ids as Celery tasks, in chunks, to the queue of its model pair."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from specbatch.config import Settings
from specbatch.errors import BrokerUnavailable
from specbatch.observability import tracing
from specbatch.redact import mask
from specbatch.worker.app import TASK_NAME, app_for

logger = logging.getLogger(__name__)

RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}


def chunks(ids: Sequence[int], size: int) -> Iterator[list[int]]:
    size = max(1, int(size))
    for i in range(0, len(ids), size):
        yield [int(x) for x in ids[i:i + size]]


def broker_error(settings: Settings, error: BaseException, job_id: str | None = None) -> BrokerUnavailable:
    fix = (f"the job {job_id} is saved: start the broker, then run `specbatch resume {job_id}`"
           if job_id else "start Redis or set SPECBATCH_BROKER_URL")
    return BrokerUnavailable(mask(f"cannot reach the broker at {settings.broker_url} ({error}); {fix}"))


def check_broker(settings: Settings, timeout: float = 3.0, retries: int = 1) -> None:
    """Raise BrokerUnavailable unless the broker answers within about ``timeout`` seconds (a refused
    connection is tried ``retries`` more times, 2 s apart)."""
    app = app_for(settings)
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=retries, timeout=timeout)
    except Exception as e:
        raise broker_error(settings, e) from e


WAIT_PROBE_SECONDS = 2.0     # a worker waiting for the broker tries this often ...
WAIT_LINE_SECONDS = 10.0     # ... and says so at most this often


def wait_for_broker(settings: Settings, say: Callable[[str], None], *,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                    check: Callable[[Settings], None] = lambda s: check_broker(s, retries=0)) -> None:
    """Return once the broker answers. While it does not: one line through ``say`` naming it
    (password masked), then a line at most every ``WAIT_LINE_SECONDS`` while it is tried every
    ``WAIT_PROBE_SECONDS``; BrokerUnavailable once ``settings.broker_wait_seconds`` have passed.
    (Celery's own start-up retries print several lines a try, for up to 100 tries, minutes.)"""
    start = said = clock()
    first = True
    while True:
        try:
            check(settings)
            if not first:
                say(f"the broker answers after {clock() - start:.0f}s; starting")
            return
        except BrokerUnavailable as e:
            cause = e.__cause__ if e.__cause__ is not None else e
            waited = clock() - start
            if waited >= settings.broker_wait_seconds:
                # 0 asked for no wait: the refused try's own moment is not one to report
                how = (f"after waiting {waited:.0f}s (SPECBATCH_BROKER_WAIT_SECONDS)" if settings.broker_wait_seconds > 0
                       else "(SPECBATCH_BROKER_WAIT_SECONDS=0: no wait)")
                raise BrokerUnavailable(mask(
                    f"cannot reach the broker at {settings.broker_url} ({cause}) {how}; "
                    "start Redis or set SPECBATCH_BROKER_URL")) from e
            if first:
                say(mask(f"cannot reach the broker at {settings.broker_url} ({cause}); waiting up to "
                         f"{settings.broker_wait_seconds:.0f}s for it (SPECBATCH_BROKER_WAIT_SECONDS), "
                         f"trying every {WAIT_PROBE_SECONDS:.0f}s"))
                first = False
            elif clock() - said >= WAIT_LINE_SECONDS:
                say(f"still no broker after {waited:.0f}s of {settings.broker_wait_seconds:.0f}s")
                said = clock()
        sleep(min(WAIT_PROBE_SECONDS, max(0.0, settings.broker_wait_seconds - (clock() - start))))


def enqueue_requests(settings: Settings, job_id: str, request_ids: list[int], queue: str) -> int:
    """Send ``request_ids`` as tasks of ``settings.chunk_size`` ids to ``queue``; returns the count.

    Raises BrokerUnavailable when the broker cannot be reached. Tasks already sent stay sent: the
    requests are rows, so ``specbatch resume`` re-enqueues whatever is still pending, and a
    request enqueued twice is still generated once (claims skip it).
    """
    from specbatch.db import database_id

    app = app_for(settings)
    database = database_id(settings.database_url)   # (a worker of another database passes it on)
    sent = 0
    try:
        with tracing.span("enqueue", {"specbatch.job.id": job_id, "specbatch.queue": queue}), \
                app.connection_for_write() as conn:
            headers = tracing.inject() or None   # the trace context, for the chunk spans
            conn.ensure_connection(max_retries=1, timeout=3)
            with app.producer_or_acquire() as producer:
                for chunk in chunks(request_ids, settings.chunk_size):
                    app.send_task(TASK_NAME, args=[job_id, chunk], kwargs={"database": database},
                                  queue=queue, routing_key=queue,
                                  producer=producer, retry=True, retry_policy=RETRY_POLICY,
                                  headers=headers)
                    sent += 1
    except BrokerUnavailable:
        raise
    except Exception as e:
        if sent:    # a partial send is worth a line; none sent (the broker was down): the error says it all
            logger.warning("job %s: %d task(s) sent before the broker failed", job_id, sent)
        raise broker_error(settings, e, job_id) from e
    return sent


def enqueue_routes(settings: Settings, job_id: str, routes: dict[Any, list[int]], job_queue: str,
                   job_drafters: Sequence[str]) -> dict[str, int]:
    """Send each route's requests (store.request_routes: None -> the job's ``job_queue``,
    (target, drafts) -> that pair's queue, ``queues.route_queue``) as tasks; returns {queue: tasks
    sent}. Raises BrokerUnavailable like enqueue_requests."""
    from specbatch.worker.queues import route_queue

    sent: dict[str, int] = {}
    for route, ids in routes.items():
        if ids:
            queue = route_queue(route, job_queue, job_drafters)
            sent[queue] = sent.get(queue, 0) + enqueue_requests(settings, job_id, ids, queue)
    return sent
