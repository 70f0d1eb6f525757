"""Validated requests in, a queued job out: how `specbatch submit`/`run` and POST /v1/batches make jobs.

    parsed = intake.read_file(path, defaults, settings, model_map)      # or intake.read_stream(...)
    with factory.begin() as s:
        job_id, routes = store_job(s, parsed, pair=pair, defaults=defaults, source=path)
    enqueue_routes(settings, job_id, routes, pair.queue, pair.drafts)
    # or both at once: submit_job(settings, factory, parsed, pair=pair, defaults=defaults, source=path)

The job and its request rows are written in one transaction; tasks are sent after it commits (a
worker must find the rows). ``check_broker`` first keeps a dead broker from leaving a saved job
nobody will run. (The CLI calls the two steps itself, each in its own trace span.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from specbatch.config import Settings
from specbatch.engine.drafter_specs import DrafterSpec, model_names, names, parse_drafters
from specbatch.engine.known_models import name_problem, tokenizer_mismatch
from specbatch.errors import ModelLoadError
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedFile
from specbatch.worker import enqueue
from specbatch.worker.queues import queue_name


@dataclass(frozen=True)
class Pair:
    """The models a job runs on (``drafters``: its pool, ``drafter_specs.parse_drafters``); its
    queue follows from them."""

    target: str
    drafters: tuple[DrafterSpec, ...] = ()

    @property
    def drafts(self) -> list[str]:
        """The pool as the database, the queue and a worker's engine spec hold it."""
        return names(self.drafters)

    @property
    def queue(self) -> str:
        return queue_name(self.target, self.drafters)

    @classmethod
    def resolve(cls, settings: Settings, target: str | None, drafts: Sequence[str],
                add: Sequence[str] = ()) -> Pair:
        """No model given: the default pair from settings. A target alone runs without a draft.
        ``add``: drafters added to whichever pool that is (``--ngram``). A drafter spec that is
        not available, or a name that is no model here (neither known, nor a model path on this
        machine, nor a Hugging Face id), is refused before a job waits for a worker that never
        comes (ModelLoadError, the message ``run`` gives); a name, unless
        ``settings.allow_remote_models``."""
        pool = [settings.default_draft] if target is None and not drafts else list(drafts)
        pair = cls(target or settings.default_target, parse_drafters([*pool, *add]))
        check_names([pair.target, *model_names(pair.drafters)], settings)
        # known names' tokenizers are known anywhere: refused even for remote models
        if problem := tokenizer_mismatch(pair.target, model_names(pair.drafters)):
            raise ModelLoadError(problem)
        return pair


def check_names(names: list[str], settings: Settings) -> None:
    """ModelLoadError for the first name that is no model on this machine (``name_problem``);
    nothing with SPECBATCH_ALLOW_REMOTE_MODELS / ``--allow-remote-models``."""
    if settings.allow_remote_models:
        return
    for name in names:
        if problem := name_problem(name):
            raise ModelLoadError(problem)


Routes = dict[Any, list[int]]     # store.request_routes: None (the job's pair) or a routed pair -> ids


@dataclass(frozen=True)
class Submission:
    job_id: str
    routes: Routes
    sent: dict[str, int]            # queue -> tasks sent

    @property
    def requests(self) -> int:
        return sum(len(ids) for ids in self.routes.values())


def read_database_id(settings: Settings) -> str:
    """The id the tasks name the database by (``db.database_id``), read before a command writes
    what they will send: read at the first send, after the write, a database lost between the two
    (or an id this role may not read) left a job saved and unsent, or failed requests pending with
    no task, under "run the command again", which submitted the file twice (review53b)."""
    from specbatch.db import database_id

    return database_id(settings.database_url)


def store_job(s: Session, parsed: ParsedFile, *, pair: Pair, defaults: dict[str, Any], source: str | None,
              metadata: dict[str, Any] | None = None, cache: bool = True) -> tuple[str, Routes]:
    """Write the job and its pending requests in the caller's transaction; (job id, ids per route).
    ``cache=False``: ``--no-cache`` (the job never takes results from the results cache)."""
    job = store.create_job(s, target=pair.target, drafts=pair.drafts, params=defaults,
                           requests=parsed.requests, queue=pair.queue, source=source, metadata=metadata,
                           cache=cache)
    return job.id, store.request_routes(s, job.id, store.resumable_request_ids(s, job.id), by_prefix=True)


def submit_job(settings: Settings, factory: sessionmaker, parsed: ParsedFile, *, pair: Pair,
               defaults: dict[str, Any], source: str | None, metadata: dict[str, Any] | None = None,
               with_job: Callable[[Session, str], Any] | None = None, cache: bool = True) -> Submission:
    """Store the job, then send its tasks. ``with_job(session, job_id)`` writes more rows in the
    job's transaction (the API's batch). Raises BrokerUnavailable if the send fails (the job is
    saved: ``specbatch resume`` re-sends it)."""
    read_database_id(settings)
    with factory.begin() as s:
        job_id, routes = store_job(s, parsed, pair=pair, defaults=defaults, source=source, metadata=metadata,
                                   cache=cache)
        if with_job is not None:
            with_job(s, job_id)
    sent = enqueue.enqueue_routes(settings, job_id, routes, pair.queue, pair.drafts)
    return Submission(job_id=job_id, routes=routes, sent=sent)
