"""A batch whose queue no live worker consumes: one server log line, so whoever runs the server
learns why a batch the openai client polls never moves. (`specbatch submit` and `status` warn on
their stderr; an API client has no such channel, and ``/healthz`` answers for the server itself,
which is healthy.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from specbatch.config import Settings

logger = logging.getLogger(__name__)


class QueueWatch:
    """Asks the workers (one broadcast of about a second, on a thread of its own: not the health
    checks', whose probes must not wait behind it) whether a new batch's queues have a consumer,
    after its answer was sent. An answer is kept ``every`` seconds: a client creating many batches
    costs the broker one broadcast, and each batch still gets its line."""

    def __init__(self, settings: Settings, every: float = 10.0) -> None:
        self.settings, self.every = settings, every
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specbatch-consumers")
        self._answers: dict[str, tuple[float, bool]] = {}     # queue -> (when, none consumes it)

    def created(self, batch_id: str, queues: Iterable[str]) -> None:
        for queue in queues:
            try:
                self.executor.submit(self._check, batch_id, queue)
            except RuntimeError:        # shut down (the server stops): the batch stands, unwarned
                return

    def _check(self, batch_id: str, queue: str) -> None:
        from specbatch.worker.monitor import none_consumes, queue_workers, this_database

        when, none = self._answers.get(queue, (-self.every, False))
        if time.monotonic() - when >= self.every:
            try:
                workers = queue_workers(self.settings, queue)
            except Exception as e:      # a warning's probe: never the batch's failure
                logger.info("could not ask the workers for queue %s (%s)", queue, type(e).__name__)
                return
            if workers is None:         # the broker is down: /healthz and the next send say so
                return
            none = none_consumes(workers, this_database(self.settings, workers))
            self._answers[queue] = (time.monotonic(), none)
        if none:
            logger.warning("batch %s waits: no live worker consumes queue %s; it makes no progress until a "
                           "`specbatch worker` with its target and drafts starts against this server's "
                           "database and broker", batch_id, queue)
