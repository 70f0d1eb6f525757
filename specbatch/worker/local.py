"""A job generated in this process over its routes, with no broker: ``specbatch run`` (and
``resume`` / ``retry`` of a job it made).

A route is the pair a --model-map sends some of the job's requests to (``store.request_routes``;
None: the job's own pair). One pair is loaded at a time, each route's requests go through
``run_embedded``; a route whose pair cannot load fails its own requests with the reason and the
others go on. What the user sees (loading, progress, warnings) is the caller's, through
``RunHooks``: the CLI renders it, a test records it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specbatch.config import Settings
from specbatch.errors import SpecBatchError
from specbatch.worker.interrupt import StopRequest
from specbatch.worker.queues import route_drafters
from specbatch.worker.transaction import transact

if TYPE_CHECKING:
    from specbatch.engine.compile.prepare import CompileNotice
    from specbatch.engine.engine import Engine
    from specbatch.worker.chunk import ResultEvent

RUN_WORKER = "specbatch-run"   # who failed a route's requests (its pair could not load)


@dataclass(frozen=True)
class LoadOptions:
    """How this process loads and decodes a pair (``specbatch run``'s options)."""

    device: str
    dtype: str
    batch_size: int | str
    compile: str = "off"
    max_memory: int | None = None
    prefix_cache: bool = True
    processes: int = 1            # on a CPU, forked after the load, each decoding part of a route


@dataclass(frozen=True)
class LocalJob:
    """A job to generate here: its own pair and its requests by route."""

    job_id: str
    target: str
    drafts: list[str]
    routes: dict[Any, list[int]]
    resumed: bool = False         # an existing job (--resume, resume, retry): not made by this call
    status: str = ""              # its status when it was read


@dataclass
class RunHooks:
    """What the caller shows while a job runs here."""

    # load a pair (target, drafters, its requests' max_new_tokens) and show it: ``load_pair`` inside
    load: Callable[[str, list[str], list[int]], Engine]
    # (job id, requests of a route) -> a block that is told each result
    progress: Callable[[str, int], AbstractContextManager[Callable[[ResultEvent], None]]]
    warn: Callable[[str], None] = field(default=lambda _line: None)


def load_pair(settings: Settings, options: LoadOptions, target: str, drafts: list[str],
              expected_new_tokens: list[int] | None = None,
              notify: Callable[[CompileNotice], None] | None = None) -> Engine:
    """The engine of a pair; any failure to load is a ``SpecBatchError`` (a loader bug too: it
    must leave no job behind and read as one line)."""
    from specbatch.engine import Engine
    from specbatch.errors import ModelLoadError

    try:
        return Engine.load(target, drafts, device=options.device, dtype=options.dtype,
                           cache_dir=settings.cache_dir or None, batch_size=options.batch_size,
                           compile=options.compile, max_memory=options.max_memory,
                           expected_new_tokens=expected_new_tokens, notify=notify,
                           prefix_cache=options.prefix_cache, linears=settings.linears)
    except SpecBatchError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load {target}: {type(e).__name__}: {e}") from e


def resumable_job(sf: Any, job_id: str) -> LocalJob:
    """An existing job's requests left to generate (pending, lease-expired or still leased), by
    route; ``sf``: a session factory."""
    return transact(sf, _resumable_job, job_id)


def _resumable_job(s: Any, job_id: str) -> LocalJob:
    from specbatch.jobs import store

    job = store.get_job(s, job_id)
    ids = store.resumable_request_ids(s, job.id) + [rid for rid, _, _ in store.leased_requests(s, job.id)]
    return LocalJob(job.id, job.target, list(job.drafts or []), store.request_routes(s, job.id, ids),
                    resumed=True, status=job.status.value)


def run_job(settings: Settings, job: LocalJob, options: LoadOptions, hooks: RunHooks, *,
            stop: StopRequest | None = None) -> bool:
    """Generate ``job``'s routes one pair at a time, each loaded by ``hooks.load`` (which may hand
    back one loaded before); False when ``stop`` interrupted it (the job is then marked
    interrupted, see ``run_embedded``). A failure of the engine itself propagates; finished
    results are kept either way."""
    name_runner(settings, job.job_id)
    try:
        return _run_routes(settings, job, options, hooks, stop)
    except KeyboardInterrupt:
        # a second Ctrl-C where no decode runs (a next pair loading): the job is interrupted all
        # the same, as ``run_embedded`` marks it where one lands mid-step
        _interrupted(settings, job.job_id)
        raise
    finally:
        name_runner(settings, job.job_id, running=False)     # (not reached where it is killed)


def _run_routes(settings: Settings, job: LocalJob, options: LoadOptions, hooks: RunHooks,
                stop: StopRequest | None) -> bool:
    engine: Engine | None = None
    loaded = None
    for route, ids in job.routes.items():
        pair = (route[0], route_drafters(route[1], job.drafts)) if route is not None else (job.target, job.drafts)
        if engine is None or pair != loaded:
            engine = loaded = None     # (the previous pair's memory goes before the next pair loads)
            try:
                engine = hooks.load(pair[0], pair[1], token_budgets(settings, job.job_id, ids))
                loaded = pair
            except SpecBatchError as e:
                if job.resumed and len(job.routes) == 1:
                    raise
                reason = f"cannot load the models: {e}"
                hooks.warn(reason)
                fail_requests(settings, job.job_id, ids, reason)
                continue
        # every route's own ids; a job of one pair made here: all of it (nothing else is pending)
        only = ids if len(job.routes) > 1 or job.resumed else None
        with hooks.progress(job.job_id, len(ids)) as on_result:
            if not _decode(settings, job.job_id, engine, options, hooks, on_result, only, stop):
                return False
    return True


def _decode(settings: Settings, job_id: str, engine: Engine, options: LoadOptions, hooks: RunHooks,
            on_result: Callable[[ResultEvent], None], only: list[int] | None, stop: StopRequest | None) -> bool:
    """One route's requests through ``engine``: in this process, or in ``options.processes``."""
    from specbatch.engine.threads import decode_here
    from specbatch.worker.embedded import run_embedded
    from specbatch.worker.forked import forkable, run_forked

    if options.processes > 1:
        if (why := forkable(engine, settings.database_url)) is None:
            return run_forked(settings, job_id, engine, options.processes, on_result,
                              batch_size=options.batch_size, only=only, stop=stop)
        hooks.warn(f"decoding in one process, not {options.processes}: {why}")
        decode_here(options.processes)
    return run_embedded(settings, job_id, engine, on_result, batch_size=options.batch_size, only=only,
                        stop=stop)


def name_runner(settings: Settings, job_id: str, running: bool = True) -> None:
    """This process runs the job from now on (``store.set_runner``), named before any load: one
    killed while it loads holds no rows to be known by; ``running`` False: it no longer does."""
    from specbatch.db import session_factory
    from specbatch.jobs import store
    from specbatch.worker.embedded_names import embedded_worker_name

    transact(session_factory(settings.database_url), store.set_runner, job_id, embedded_worker_name(), running)


def _interrupted(settings: Settings, job_id: str) -> None:
    from specbatch.db import session_factory
    from specbatch.worker.embedded import wrap_up
    from specbatch.worker.embedded_names import embedded_worker_name

    transact(session_factory(settings.database_url), wrap_up, job_id, embedded_worker_name(), False)


def fail_requests(settings: Settings, job_id: str, ids: list[int], reason: str) -> None:
    from specbatch.db import session_factory

    transact(session_factory(settings.database_url), _fail_requests, job_id, ids, reason)


def _fail_requests(s: Any, job_id: str, ids: list[int], reason: str) -> None:
    from specbatch.jobs import store

    for rid in ids:
        store.record_failure(s, rid, reason, RUN_WORKER, error_type=store.SERVER_ERROR)
    store.refresh_job(s, job_id)


def token_budgets(settings: Settings, job_id: str, request_ids: list[int]) -> list[int]:
    """These requests' max_new_tokens: what auto compile weighs compiling by."""
    from specbatch.db import session_factory
    from specbatch.jobs import store

    return transact(session_factory(settings.database_url, readonly=True), store.token_budgets, job_id,
                    request_ids)
