"""The worker's circuit breaker: stop consuming while the database is down or the target keeps
failing, probe with back-off, resume by itself.

Database outage (inside a task): the task keeps its message (unacked, so no other message is
taken: one pool child, prefetch 1), the worker's consumer of the queue is cancelled (Flower's
worker page then lists no active queue, the log says why), the database is probed after 1, 2,
4 ... ``breaker_max_backoff`` seconds, and once it answers the queue is consumed again and the
chunk is run again from where it stopped (finished requests are skipped; the requests this
worker held are released first, so an outage never costs a request one of its attempts).

Broker outage: Celery's consumer already stops and reconnects with back-off
(``broker_connection_retry``, ``broker_connection_max_retries=None``); running tasks go on and
their results land in the database; an ack lost with the connection only means the message
is delivered again, and claims skip what is finished.

Target failures: ``TargetHealth`` counts consecutive failures of the engine (not of a request's
own input); at ``target_failure_limit`` the worker marks itself unhealthy, stops consuming and
refuses what it still receives, so the queue drains to healthy workers instead of failing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from specbatch.errors import OUT_OF_MEMORY_ADVICE, one_line, out_of_memory
from specbatch.redact import mask

logger = logging.getLogger(__name__)


def wait_until_up(probe: Callable[[], None], *, what: str, first: float = 1.0, maximum: float = 60.0,
                  sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``probe`` after 1, 2, 4 ... (at most ``maximum``) seconds until it does not raise;
    returns how many probes it took. Never a hot loop: every probe waits first."""
    delay, probes = first, 0
    while True:
        sleep(delay)
        probes += 1
        try:
            probe()
        except Exception as e:
            delay = min(delay * 2, maximum)
            logger.warning("breaker open: %s still down (%s); next probe in %.0fs", what,
                           mask(str(e).splitlines()[0] if str(e) else type(e).__name__), delay)
            continue
        logger.warning("breaker closed: %s is back after %d probe(s)", what, probes)
        return probes


def probe_database(url: str) -> Callable[[], None]:
    def probe() -> None:
        from specbatch.db import get_engine

        with get_engine(url).connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    return probe


def set_consuming(app: Any, hostname: str | None, queue: str | None, on: bool, reason: str = "") -> None:
    """Ask this worker's consumer (the parent process) to start/stop consuming ``queue``."""
    if not hostname or not queue:
        return
    try:
        if on:
            app.control.add_consumer(queue, destination=[hostname], reply=False)
        else:
            app.control.cancel_consumer(queue, destination=[hostname], reply=False)
    except Exception as e:   # the broker is down too: nothing is being consumed anyway
        logger.warning("cannot %s consuming %s: %s", "resume" if on else "pause", queue, mask(str(e)))
        return
    if on:
        logger.warning("consuming %s again", queue)
    else:
        logger.error("paused: not consuming %s (%s)", queue, mask(reason))


class TargetHealth:
    """Consecutive target failures of this process; unhealthy at ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.failures, self.last_error = limit, 0, ""
        self.out_of_memory = False      # the last failure was the device's memory, not the device

    @property
    def unhealthy(self) -> bool:
        return self.failures >= self.limit

    def ok(self) -> None:
        self.failures = 0

    def failed(self, error: BaseException) -> bool:
        """Count a failure; True when this one made the worker unhealthy."""
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {one_line(error)}"
        self.out_of_memory = out_of_memory(error)
        return self.failures == self.limit

    @property
    def remedy(self) -> str:
        """What brings an unhealthy worker back: a device that ran out of memory runs out again
        after a restart as it was (the same budget, the same batches), unlike one that failed."""
        if self.out_of_memory:
            return f"{OUT_OF_MEMORY_ADVICE}, then restart it"
        return "restart it once the device is fixed"
