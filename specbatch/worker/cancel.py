"""``cancel`` reaches the rows a worker is already generating.

A chunk's claim is the cancellation check between prompts; but with batching (``--batch-size
auto`` may claim a whole job at once) every claimed row would run to its end after a cancel.
``CancelWatch`` looks at the job's status every second while a chunk runs; once the job is
cancelling it sets a ``StopRequest``, and ``interruptible`` makes the engine raise ``Interrupted``
before the next decoder layer of any of its models, drafts included (the engine knows nothing of
jobs). So a cancel reaches the rows within this second plus one layer's forward. The task then releases what it
held: rows of a cancelled job become ``cancelled``, their partial text is not stored.
"""

from __future__ import annotations

import logging
import threading

from specbatch.config import Settings
from specbatch.worker.interrupt import StopRequest

logger = logging.getLogger(__name__)

CHECK_SECONDS = 1.0


def job_stopping(settings: Settings, job_id: str) -> bool:
    from specbatch.db import session_factory
    from specbatch.db.models import Job
    from specbatch.jobs.store import STOPPING_JOB

    with session_factory(settings.database_url).begin() as s:
        job = s.get(Job, job_id)
        return job is not None and job.status in STOPPING_JOB


class CancelWatch:
    """``with CancelWatch(settings, job_id) as stop:``: ``stop`` is set once the job is cancelled.

    ``stop``: the request to set (``specbatch run`` passes its Ctrl-C one, so that either ends the
    decode); a fresh one by default."""

    def __init__(self, settings: Settings, job_id: str, interval: float = CHECK_SECONDS,
                 stop: StopRequest | None = None) -> None:
        self.settings, self.job_id, self.interval = settings, job_id, interval
        self.stop = stop or StopRequest()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specbatch-cancel-watch", daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                if job_stopping(self.settings, self.job_id):
                    self.stop.event.set()
                    return
            except Exception as e:   # the database is down: the chunk's own writes meet that; look again
                logger.debug("cancel check of job %s failed: %s", self.job_id, e)

    def __enter__(self) -> StopRequest:
        self._thread.start()
        return self.stop

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)
