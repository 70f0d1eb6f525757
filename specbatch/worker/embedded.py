"""``specbatch run``: the same chunk code as the Celery task, in this process, with no broker."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from specbatch.config import Settings
from specbatch.observability import tracing
from specbatch.observability.worker import Observer
from specbatch.worker.chunk import ResultEvent, batch_rows, process_chunk, with_db_retry
from specbatch.worker.enqueue import chunks

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine

logger = logging.getLogger(__name__)


def run_embedded(settings: Settings, job_id: str, engine: Engine,
                 on_progress: Callable[[ResultEvent], None] | None = None, *,
                 batch_size: int | str | None = None, should_stop: Callable[[], bool] | None = None,
                 only: Collection[int] | None = None) -> None:
    """Generate every pending (or lease-expired) request of ``job_id`` (of those in ``only``, when
    given: the requests routed to ``engine``'s models), chunk by chunk."""
    from specbatch.db import session_factory
    from specbatch.jobs import store

    sf = session_factory(settings.database_url)
    keep = None if only is None else set(only)

    def resumable() -> list[int]:
        with sf.begin() as s:
            ids = store.resumable_request_ids(s, job_id)
        return ids if keep is None else [i for i in ids if i in keep]

    worker = f"embedded@{socket.gethostname()}:{os.getpid()}"
    observer = Observer()   # the request spans, when tracing is on (no metrics port here)

    def on_result(event: ResultEvent) -> None:
        observer.on_result(event)
        if on_progress is not None:
            on_progress(event)

    batch = batch_rows(engine, batch_size)
    # with batching, chunks several batches long keep the batch full as rows finish; with the
    # autopilot the whole job is one chunk: its batch may grow to any size as it measures
    auto = (batch_size or engine.batch_size) == "auto"
    size = settings.chunk_size if batch == 1 else max(settings.chunk_size, 4 * batch)
    ids = with_db_retry(resumable)
    with tracing.span("run", {"specbatch.job.id": job_id, "specbatch.worker": worker}):
        for chunk in chunks(ids, len(ids) or 1) if auto else chunks(ids, size):
            with tracing.span("chunk", {"specbatch.job.id": job_id, "specbatch.request_ids": chunk}):
                report = process_chunk(settings, engine, chunk, worker, batch_size=batch_size,
                                       on_result=on_result, should_stop=should_stop)
            if report.unstarted:
                break

    def refresh() -> None:
        with sf.begin() as s:
            store.refresh_job(s, job_id)
    with_db_retry(refresh)
