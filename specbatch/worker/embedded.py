"""``specbatch run``: the same chunk code as the Celery task, in this process, with no broker."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from specbatch.config import Settings
from specbatch.observability import tracing
from specbatch.observability.worker import Observer
from specbatch.worker.cancel import CancelWatch
from specbatch.worker.chunk import ResultEvent, claim_rows, process_chunk
from specbatch.worker.embedded_names import embedded_worker_name, release_dead_embedded
from specbatch.worker.enqueue import chunks
from specbatch.worker.interrupt import Interrupted, StopRequest, interruptible
from specbatch.worker.transaction import transact

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine

logger = logging.getLogger(__name__)


def run_embedded(settings: Settings, job_id: str, engine: Engine,
                 on_progress: Callable[[ResultEvent], None] | None = None, *,
                 batch_size: int | str | None = None, stop: StopRequest | None = None,
                 only: Collection[int] | None = None) -> bool:
    """Generate every pending (or lease-expired) request of ``job_id`` (of those in ``only``, when
    given: the requests routed to ``engine``'s models), chunk by chunk.

    Returns False when ``stop`` interrupted it: the engine stopped at its next step, the results
    written so far stay, the requests it held are released (pending again, the attempt undone)
    and the job is marked interrupted (``specbatch run --resume`` finishes it). ``specbatch
    cancel`` sets ``stop`` too, as it does a worker's (``worker.cancel.CancelWatch``): the rows
    held then become cancelled and the job ``cancelled``, not interrupted.
    """
    from specbatch.db import session_factory

    sf = session_factory(settings.database_url)
    worker = embedded_worker_name()
    observer = Observer()   # the request spans, when tracing is on (no metrics port here)

    def on_result(event: ResultEvent) -> None:
        observer.on_result(event)
        if on_progress is not None:
            on_progress(event)

    batch = claim_rows(engine, batch_size)
    # with batching, chunks several batches long keep the batch full as rows finish; with the
    # autopilot the whole job is one chunk: its batch may grow to any size as it measures
    auto = (batch_size or engine.batch_size) == "auto"
    size = settings.chunk_size if batch == 1 else max(settings.chunk_size, 4 * batch)
    finished = True
    stop = stop or StopRequest()

    ids = transact(sf, ids_to_decode, job_id, None if only is None else set(only))
    try:
        with CancelWatch(settings, job_id, stop=stop), interruptible(engine, stop), \
                tracing.span("run", {"specbatch.job.id": job_id, "specbatch.worker": worker}):
            for chunk in chunks(ids, len(ids) or 1) if auto else chunks(ids, size):
                with tracing.span("chunk", {"specbatch.job.id": job_id, "specbatch.request_ids": chunk}):
                    report = process_chunk(settings, engine, chunk, worker, batch_size=batch_size,
                                           on_result=on_result, should_stop=stop)
                if report.unstarted:
                    finished = False
                    break
    except Interrupted:
        finished = False
    except BaseException:
        # the engine failed, or a second Ctrl-C (KeyboardInterrupt) ended it at once: hand back
        # what it held and mark the job interrupted, as a first Ctrl-C does
        finished = False
        raise
    finally:
        transact(sf, wrap_up, job_id, worker, finished)
    return finished


def ids_to_decode(s: Any, job_id: str, only: set[int] | None) -> list[int]:
    """The job's requests to generate (of ``only``, when given), in prefix order; the job is no
    longer interrupted and what dead ``specbatch run`` processes of this host held is released."""
    from specbatch.jobs import store
    from specbatch.jobs.prefix_order import prefix_ordered

    release_dead_embedded(s, job_id)
    store.set_interrupted(s, job_id, False)
    ids = store.resumable_request_ids(s, job_id)
    # chunked so that requests sharing a prompt prefix decode together
    return prefix_ordered(s, ids if only is None else [i for i in ids if i in only])


def wrap_up(s: Any, job_id: str, worker: str, finished: bool) -> None:
    from specbatch.jobs import store

    if not finished:
        store.release_held_by(s, job_id, worker)     # a cancelled job's: cancelled, not pending
        if store.get_job(s, job_id).status not in store.STOPPING_JOB:
            store.set_interrupted(s, job_id, True)
    store.refresh_job(s, job_id)
