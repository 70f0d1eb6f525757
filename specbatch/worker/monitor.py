"""Ask the live workers (Celery remote control) which queues they consume, and how far along
they are (``specbatch_state`` in a worker's app config, see ``specbatch.worker.runner``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specbatch.config import Settings
from specbatch.worker.app import app_for
from specbatch.worker.scratch import read_worker, scratch_dirs, source

logger = logging.getLogger(__name__)

# in a `specbatch worker`'s app config: `celery inspect conf` and Flower's worker page (Config) show it
STATE_KEY = "specbatch_state"
DATABASE_KEY = "specbatch_database"   # the id of the database a worker reads (db.database_id), None: not known
# a prefork worker's state until its pool child reports one
STARTING = "starting: loading models"


# answered by specbatch.worker.panel: a worker's queues and state in one reply
VIEW_COMMAND = "specbatch_view"


def _inspect(settings: Settings, command: str, timeout: float) -> dict[str, Any] | None:
    """worker name -> its reply to the remote-control ``command``, after one broadcast that waits
    ``timeout`` seconds past the last reply; None when the broker is unreachable."""
    from celery.app.control import flatten_reply

    app = app_for(settings)
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
            return flatten_reply(app.control.broadcast(command, reply=True, timeout=timeout, connection=conn) or [])
    except Exception as e:
        logger.debug("broker unreachable: %s", e)
        return None


def active_queues(settings: Settings, timeout: float = 1.0) -> dict[str, list[str]] | None:
    """worker name -> queue names it consumes; None when the broker is unreachable."""
    replies = _inspect(settings, "active_queues", timeout)
    if replies is None:
        return None
    return {worker: [q.get("name", "") for q in (queues or [])] for worker, queues in replies.items()}


def queue_has_consumer(settings: Settings, queue: str, timeout: float = 1.0) -> bool | None:
    """Whether a live worker consumes ``queue``; None when the broker cannot be reached."""
    workers = active_queues(settings, timeout=timeout)
    if workers is None:
        return None
    return any(queue in names for names in workers.values())


@dataclass(frozen=True)
class WorkerView:
    """A live worker of one queue, as its remote control answers."""

    name: str
    consuming: bool          # consumes the queue now
    state: str | None        # "starting: loading models", "compiling 2/4 (...)", ...; None: not said
    # online for the queue (its own), past starting, and not consuming it: it cancelled its own
    # consumer (worker.breaker: a refused task, the database down, target failures)
    paused: bool = False
    database: str | None = None   # the id of the database it reads (None: not said, an older worker)


def elsewhere(workers: Sequence[WorkerView], here: str | None) -> set[str]:
    """The workers that read another database than ``here`` (this command's id; None: unknown):
    they pass this database's tasks on unrun."""
    return {w.name for w in workers if here and w.database and w.database != here}


def this_database(settings: Settings, workers: Sequence[WorkerView]) -> str | None:
    """The database id of ``settings`` (``db.database_id``), to tell the workers that read another;
    None where no worker said which it reads (older workers) or it cannot be read."""
    if not any(w.database for w in workers):
        return None
    from sqlalchemy.exc import SQLAlchemyError

    from specbatch.db import database_id

    try:
        return database_id(settings.database_url)
    except SQLAlchemyError:     # the caller's own error says it; this is a warning's detail
        return None


def none_consumes(workers: Sequence[WorkerView], here: str | None) -> bool:
    """Whether no worker will run this database's tasks of the queue: each paused, or reading
    another database (the CLI's warning and the server's line ask the same)."""
    away = elsewhere(workers, here)
    return all(w.paused or w.name in away for w in workers)


def _views(settings: Settings, timeout: float) -> dict[str, dict[str, Any]] | None:
    """worker name -> {"queues", "default_queue", "state", "database"} (``panel.specbatch_view``);
    None when the broker is unreachable."""
    replies = _inspect(settings, VIEW_COMMAND, timeout)
    if replies is None or all(isinstance(r, dict) and "queues" in r for r in replies.values()):
        return replies
    # a worker of an older specbatch answers {"error": ...}: ask everyone the two built-in commands
    consumers, confs = active_queues(settings, timeout), _inspect(settings, "conf", timeout)
    if consumers is None or confs is None:
        return None
    return {w: {"queues": consumers.get(w, []), "default_queue": (confs.get(w) or {}).get("task_default_queue"),
                "state": (confs.get(w) or {}).get(STATE_KEY)} for w in set(consumers) | set(confs)}


def queue_workers(settings: Settings, queue: str, timeout: float = 1.0) -> list[WorkerView] | None:
    """The live workers consuming ``queue``, and the `specbatch worker`s for it still starting
    (online, not consuming until their models are loaded), so nobody is told to start another;
    None when the broker is unreachable. One broadcast, ``timeout`` past the last reply."""
    replies = _views(settings, timeout)
    if replies is None:
        return None
    views = []
    for worker, reply in sorted(replies.items()):
        state = reply.get("state")
        consuming = queue in (reply.get("queues") or [])
        own = reply.get("default_queue") == queue
        starting = own and str(state or "").startswith("starting")
        if consuming or starting or own:
            views.append(WorkerView(worker, consuming, state, paused=own and not consuming and not starting,
                                    database=reply.get("database")))
    if any(not v.paused for v in views):
        return views
    # a worker that answered said what it consumes: this machine's scratch directories count only
    # those that did not answer in time (a paused one's still reads "decoding")
    return views + [v for v in starting_here(settings, queue) if v.name not in replies]


def starting_here(settings: Settings, queue: str) -> list[WorkerView]:
    """`specbatch worker`s of this machine for ``queue`` (starting, or consuming once their pool
    child reported its models loaded), from their scratch directories: one loading its models on
    a busy machine answered remote control in more than the second it is given (a new-user walk at
    load 10: `status` warned "no live worker" 30 s after a worker `submit` had seen starting).
    Only workers of the same broker and database count: one on another Redis db never takes these
    tasks (a new-user walk: `submit` on db 8 named the worker of db 7 and gave no warning)."""
    views = []
    here = source(settings)
    for d, running in scratch_dirs(settings):
        worker = read_worker(d) if running else None
        if worker is not None and worker.queue == queue and worker.source == here:
            state = STARTING if worker.state is None else worker.state
            views.append(WorkerView(worker.name, not state.startswith("starting"), state))
    return views
