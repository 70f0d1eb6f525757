"""Thin Celery tasks: take ids, call ``process_chunk``, turn its report into ack / retry.

The engine is held once per worker process by ``EngineTask``. Under ``specbatch worker`` (prefork,
one spawned pool child, see ``specbatch.worker.runner``) the child loads it in
``worker_process_init`` and then tells the parent it is ready, so the worker consumes only once
its models are loaded; that handler may block for as long as loading takes because the app
raises ``worker_proc_alive_timeout``. Compiling is not part of that: it runs in the child's
background (``specbatch.engine.background``), the child writes its progress to the state file
the parent announces. Any other pool (``celery -A specbatch.worker.app worker --pool solo``)
loads it on first use.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from celery import Task, signals
from celery.exceptions import Ignore, Reject
from kombu.exceptions import OperationalError as KombuOperationalError

from specbatch.config import get_settings
from specbatch.errors import SpecBatchError
from specbatch.observability import tracing
from specbatch.observability import worker as observe
from specbatch.worker.app import TASK_NAME, app
from specbatch.worker.breaker import TargetHealth, probe_database, set_consuming, wait_until_up
from specbatch.worker.cancel import CancelWatch, job_stopping
from specbatch.worker.chunk import ChunkReport, process_chunk
from specbatch.worker.guard import allows_fallback, draft_only, refusal
from specbatch.worker.interrupt import Interrupted, interruptible
from specbatch.worker.panel import specbatch_view  # noqa: F401 - registers the remote-control command
from specbatch.worker.transaction import TRANSIENT_DB_ERRORS, transact

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine

logger = logging.getLogger(__name__)

MAX_RETRIES = 100          # worker-lost resends + waits for held leases + transient errors, together
# a task of another database: sent back 5, 10, 20, ... 300 s later, dropped at the 12th try (~30 min)
FOREIGN_FIRST_WAIT, FOREIGN_LAST_WAIT, FOREIGN_TRIES = 5.0, 300.0, 12


def engine_spec(conf: Any) -> dict[str, Any]:
    """What this worker holds: ``specbatch_engine`` from the app config, else the default pair."""
    spec = conf.get("specbatch_engine")
    if spec:
        return dict(spec)
    s = get_settings()
    return {"target": s.default_target, "drafts": [s.default_draft],
            "device": s.device, "dtype": s.dtype, "batch_size": s.batch_size, "compile": s.compile,
            "threads": s.threads or None, "prefix_cache": s.prefix_cache}


def build_engine(spec: dict[str, Any], on_state: Callable[[str], None] | None = None) -> Engine:
    """Load the engine for ``spec`` (tests wrap this to inject faults); it compiles in the
    background (``on_state`` hears how far), so the worker consumes eagerly at once."""
    from specbatch.engine import Engine
    from specbatch.engine.compile.inductor import use_cache_dir
    from specbatch.engine.threads import configure_threads

    settings = get_settings()
    mode = spec.get("compile") or "off"      # the compile decision, read once for both uses
    configure_threads(spec.get("threads"), settings.local_workers, settings.lanes)   # before the first forward
    if settings.cache_dir and mode != "off":   # caches shared across starts
        use_cache_dir(settings.cache_dir)
    return Engine.load(spec["target"], list(spec.get("drafts") or ()),
                       device=spec.get("device", "cpu"), dtype=spec.get("dtype", "float32"),
                       cache_dir=settings.cache_dir or None, batch_size=spec.get("batch_size") or "auto",
                       max_memory=spec.get("max_memory"), prefix_cache=bool(spec.get("prefix_cache", True)),
                       linears=settings.linears,
                       # a worker compiles in the background (auto: it is long-lived), eager meanwhile
                       compile=mode, background=on_state or True)


def load_engine(conf: Any) -> Engine:
    """``build_engine`` for the app config ``conf``, its compile progress written to the state
    file the parent announces; says why auto decodes eagerly, as compiling says that it compiles."""
    state_file = conf.get("specbatch_state_file")
    engine = build_engine(engine_spec(conf),
                          (lambda state: _write_ready(state_file, state + "\n")) if state_file else None)
    plan = engine.compile_plan
    if (plan is not None and plan.mode == "auto" and not plan.enabled
            and getattr(engine, "background", None) is None   # it says so itself when done
            and not any(m.error for m in plan.models)):       # (a failure already warned)
        logger.info("%s: decoding eagerly: %s", engine.target_name, plan.reason)
    return engine


def _rows_now(batch_size: Any, engine: Engine | None) -> int | None:
    """A fixed --batch-size, or with auto ``Engine.rows_now`` (the gauge then follows it after
    each chunk); None before the engine is loaded."""
    if batch_size not in (None, "", "auto"):
        return int(batch_size)
    return engine.rows_now() if engine is not None else None


def _write_ready(path: str | None, text: str) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"   # the compile thread writes states too
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _redact_logs(logger: Any = None, **_: Any) -> None:
    """Worker logs (parent and pool child) never show a password: see ``specbatch.redact``."""
    from specbatch.redact import install_log_redaction

    install_log_redaction(logger)
    install_log_redaction()


class _RejectWithoutTrace(logging.Filter):
    """Celery logs a rejected task (``Reject``: refused by this worker, or sent back at a warm
    shutdown) at WARNING with the stack trace of the raise under the line, one per refusing worker
    and task. The line already names the task and the reason (and a REFUSED line before it says
    why), so the trace is dropped: no traceback in a log line for an outcome we chose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info, record.exc_text = None, None
        return True


# a logger's filter, not a handler's: it holds whatever handlers the worker's log set-up installs,
# in the parent and in every pool child (each imports this module)
if not any(isinstance(f, _RejectWithoutTrace) for f in logging.getLogger("celery.app.trace").filters):
    logging.getLogger("celery.app.trace").addFilter(_RejectWithoutTrace())


@signals.worker_process_init.connect
def _load_in_pool_child(sender: Any = None, **_: Any) -> None:
    """A fresh pool child: drop any inherited DB pool, load the models, report ready or the error."""
    from specbatch.db import dispose_engines

    dispose_engines()
    from celery import current_app

    conf = current_app.conf  # the worker's app (spawned children get it pickled, config included)
    ready = conf.get("specbatch_ready_file")
    if not conf.get("specbatch_engine"):
        return  # a plain `celery -A ... worker`: load lazily on first task
    task = current_app.tasks[TASK_NAME]
    try:
        task.prepare()
    except Exception as e:  # reported to the parent, which exits non-zero with this message
        logger.error("cannot load models: %s", e)
        _write_ready(ready, f"error\n{e}")
        return
    engine = task.engine
    if getattr(engine, "background", None) is None:   # compile off (or nothing to compile): that is all there is
        plan = getattr(engine, "compile_plan", None)
        state = f"eager: {plan.reason}" if plan is not None and plan.mode != "off" else "ready (eager)"
        _write_ready(conf.get("specbatch_state_file"), state + "\n")
    _write_ready(ready, "ok\n")


@signals.worker_process_shutdown.connect
def _flush_spans(**_: Any) -> None:
    tracing.shutdown()


def _worker_name(task: Task) -> str:
    host = getattr(task.request, "hostname", None) or socket.gethostname()
    return f"{host}:{os.getpid()}"


def _should_stop() -> bool:
    """True once a warm shutdown began in this process (solo pool; prefork children never see it)."""
    from celery.worker import state

    return bool(state.should_stop is not None or state.should_terminate is not None)


def _countdown(settings: Any, seconds: float) -> float:
    """A retry delay kept under half the visibility timeout: Redis would redeliver a longer ETA."""
    return max(0.5, min(seconds, settings.visibility_timeout / 2))


class EngineTask(Task):
    """The task class: Celery makes one instance per app in each worker process, so it holds what
    the process keeps between tasks (Celery's task guide, "Instantiation"): the loaded engine, the
    target's health, the queues refused, the compile plan the metrics show. Ids in, nothing out
    (results live in our tables)."""

    ignore_result = True
    acks_late = True
    max_retries = MAX_RETRIES
    default_retry_delay = 1   # the worker-lost resend; Task's own default is 180 s

    _engine: Engine | None = None
    _shown_plan: Any = None   # the compile plan the metrics show

    @property
    def engine(self) -> Engine:
        """This process's engine, loaded on first use (``worker_process_init`` does it early)."""
        if self._engine is None:
            self._engine = load_engine(self.app.conf)
        return self._engine

    def prepare(self) -> observe.Observer:
        """Load the engine now (before consuming) and start this process's observer."""
        engine = self.engine
        observer = self.observer
        observer.set_compile_plan(engine.compile_plan)
        self._shown_plan = engine.compile_plan
        return observer

    @cached_property
    def health(self) -> TargetHealth:
        """Consecutive target failures of this process."""
        return TargetHealth(get_settings().target_failure_limit)

    @cached_property
    def refused(self) -> set[str]:
        """Queues this process refused a task of (a misconfigured worker)."""
        return set()

    @property
    def observer(self) -> observe.Observer:
        """This process's metrics/traces hook (``specbatch_observe`` from ``specbatch worker``)."""
        conf = self.app.conf
        spec, opts = engine_spec(conf), conf.get("specbatch_observe") or {}
        return observe.start(target=spec["target"], drafters=spec.get("drafts") or (),
                             worker=opts.get("worker") or socket.gethostname(), metrics=bool(opts.get("metrics")),
                             batch_size=_rows_now(spec.get("batch_size"), self._engine))

    def show_decoding(self, engine: Engine) -> None:
        """After a chunk: what decoding keeps now on the gauges, and a background compile's plan
        once it was adopted in place of the eager one."""
        observer = self.observer
        plan = getattr(engine, "compile_plan", None)
        if plan is not None and plan is not self._shown_plan:
            self._shown_plan = plan
            observer.set_compile_plan(plan)
        observer.set_decoding(batch_size=engine.rows_now(), speculation=engine.speculating_now())

    def decoder_for(self, settings: Any, job_id: str) -> Engine | None:
        """The engine for this task: None (this process's), the draft alone (lossy) for a
        --fallback-draft job once the target is unhealthy; a Reject when this worker cannot take it."""
        engine = None
        if self.health.unhealthy and _fallback_ok(settings, job_id):
            engine = draft_only(self.engine)
        elif self.health.unhealthy:
            raise _refuse(self, f"worker unhealthy after {self.health.failures} target failures "
                                f"({self.health.last_error}); {self.health.remedy}")
        if _queue(self) in self.refused:
            raise _refuse(self, "this worker refused a task of this queue before")
        return engine

    def generate(self, settings: Any, engine: Engine, job_id: str, request_ids: list[int],
                 worker: str) -> ChunkReport:
        """Guard, then the chunk itself, traced, stopped at the next step if the job is cancelled."""
        from specbatch.db import session_factory

        reason = transact(session_factory(settings.database_url), refusal, job_id, request_ids,
                          engine_spec(self.app.conf), settings.database_url)
        if reason is not None:
            raise _refuse(self, reason)
        with tracing.continued(tracing.headers_of(self.request), "chunk",
                               {"specbatch.job.id": job_id, "specbatch.request_ids": request_ids,
                                "specbatch.worker": worker}):
            with CancelWatch(settings, job_id) as cancelled, interruptible(engine, cancelled):
                report = process_chunk(settings, engine, request_ids, worker,
                                       on_result=self.observer.on_result, should_stop=_should_stop)
        self.show_decoding(engine)
        return report

    def pass_on(self, settings: Any, job_id: str, passes: int, why: str, dropped: str) -> BaseException:
        """A task this worker should not run and another worker may: its job is in another
        database than this worker's (a submitter with another SPECBATCH_DATABASE_URL on this
        broker), or a newer specbatch sent it with arguments this one does not know (a rolling
        upgrade). No sign that this worker is misconfigured, and pausing this queue, as a refusal
        does, held up every job of this worker's own database behind it (qa53). So it goes back
        for another worker, later each time, this queue still consumed; at the ``FOREIGN_TRIES``-th
        try it is dropped: its requests stay pending in their database, where ``specbatch resume``
        sends them again (docs/DESIGN.md, "Tasks of another database").

        ``why``: what is wrong with it here; ``dropped``: what to do once it is dropped.
        ``passes``: how often workers passed it on before, carried in the task's kwargs. Not
        Celery's ``request.retries``, which counts every retry of the message (waits for a lease,
        transient errors and worker-lost resends in its own database): a task that had waited on
        leases 11 times was dropped at its first pass (review53b)."""
        if passes + 1 >= FOREIGN_TRIES:
            reason = f"{why}, and no other worker took it in {passes + 1} tries; {dropped}"
            logger.error("DROPPED task %s: %s", self.request.id, reason)
            return Reject(reason, requeue=False)
        wait = _countdown(settings, min(FOREIGN_LAST_WAIT, FOREIGN_FIRST_WAIT * 2 ** passes))
        logger.warning("REFUSED task %s: %s: back to %s in %.0f s for another worker (try %d of %d); "
                       "this worker goes on consuming it", self.request.id, why, _queue(self), wait, passes + 1,
                       FOREIGN_TRIES)
        return self.retry(kwargs={**(self.request.kwargs or {}), "passes": passes + 1}, countdown=wait)

    def wait_for_database(self, settings: Any, error: BaseException, job_id: str, worker: str) -> None:
        """The database is down: stop consuming, probe until it answers, release what this
        worker held, consume again."""
        queue = _queue(self)
        set_consuming(self.app, self.request.hostname, queue, on=False,
                      reason=f"database unreachable: {str(error).splitlines()[0]}")
        wait_until_up(probe_database(settings.database_url), what="the database",
                      maximum=settings.breaker_max_backoff)
        _release_mine(settings, job_id, worker)
        set_consuming(self.app, self.request.hostname, queue, on=True)

    def after_target_failure(self, settings: Any, job_id: str, worker: str, fallback: Engine | None,
                             error: Exception) -> Engine:
        """The target itself failed (out of memory, a CUDA error, ...): the rows are released;
        a --fallback-draft job goes on with the draft alone (returned), else the task goes back
        to the queue and enough failures in a row make this worker stop consuming."""
        logger.exception("target failure on job %s", job_id)
        _release_mine(settings, job_id, worker)
        if fallback is None and _fallback_ok(settings, job_id):
            fallback = draft_only(self.engine)
            if fallback is not None:
                logger.error("job %s: target failed; generating with the draft alone (LOSSY, "
                             "--fallback-draft): results are flagged lossy", job_id)
                return fallback
        if self.health.failed(error):
            set_consuming(self.app, self.request.hostname, _queue(self), on=False,
                          reason=f"worker unhealthy: {self.health.failures} target failures in a row "
                                 f"({self.health.last_error}); {self.health.remedy}")
        raise Reject(f"target failure: {error}", requeue=True) from error


def _revoked(task: Task) -> Ignore:
    """A revoked task, as Flower and `celery events` show one: returning would report it SUCCESS;
    Ignore acknowledges the message and sends no task-succeeded after this."""
    task.send_event("task-revoked", terminated=False, signum=None, expired=False)
    return Ignore()


def _queue(task: Task) -> str | None:
    info = getattr(task.request, "delivery_info", None) or {}
    return info.get("routing_key") or info.get("queue")


def _refuse(task: EngineTask, reason: str) -> Reject:
    """Stop consuming this queue and send the task back to it for a worker that fits."""
    queue = _queue(task)
    logger.error("REFUSED task %s: %s; back to %s", task.request.id, reason, queue)
    if queue is not None:
        task.refused.add(queue)
    set_consuming(task.app, task.request.hostname, queue, on=False, reason=reason)
    return Reject(reason, requeue=True)


def _fallback_ok(settings: Any, job_id: str) -> bool:
    from specbatch.db import session_factory

    return transact(session_factory(settings.database_url), allows_fallback, job_id)


def _release_mine(settings: Any, job_id: str, worker: str) -> list[int]:
    from specbatch.db import session_factory

    return transact(session_factory(settings.database_url), _release, job_id, worker)


def _release(s: Any, job_id: str, worker: str) -> list[int]:
    from specbatch.jobs import store

    ids = store.release_held_by(s, job_id, worker)
    store.refresh_job(s, job_id)
    return ids


@app.task(bind=True, base=EngineTask, name=TASK_NAME)
def process_chunk_task(self: EngineTask, job_id: str, request_ids: list[int],
                       database: str | None = None, passes: int = 0, **newer: Any) -> dict[str, Any]:
    """Generate the requests ``request_ids`` of job ``job_id``, which is in the database whose
    id is ``database`` (``db.database_id``; None: a task sent before tasks named it); see
    ``specbatch.worker.chunk``.

    A task of another database, or one a newer specbatch sent with arguments this one does not
    know (``newer``: a rolling upgrade), is passed on (``EngineTask.pass_on``; ``passes``: how
    often before). Guarded
    (``specbatch.worker.guard``): a job of other models, or one this worker's database lacks, is
    refused and requeued. Breaker (``specbatch.worker.breaker``): a database outage pauses this
    worker until the database answers; repeated target failures make it unhealthy.
    """
    from specbatch.db import database_id
    from specbatch.redact import mask

    settings = get_settings()
    if newer:       # before anything is read: what these arguments change is not known here
        raise self.pass_on(settings, job_id, passes,
                           f"job {job_id}'s task was sent by a newer specbatch (arguments this worker does not know: "
                           f"{', '.join(sorted(newer))})",
                           f"its requests stay pending: upgrade this job's workers, then `specbatch resume {job_id}`")
    fallback = self.decoder_for(settings, job_id)   # None: this process's engine
    worker = _worker_name(self)
    while True:
        try:
            foreign = database is not None and database != database_id(settings.database_url)
            # `cancel` leaves the job's queued tasks in the broker: each ends here, after one read
            # of the job's status (not claimed for nothing, request by request)
            report = None if foreign or job_stopping(settings, job_id) else \
                self.generate(settings, fallback or self.engine, job_id, request_ids, worker)
            break
        except TRANSIENT_DB_ERRORS as e:
            self.wait_for_database(settings, e, job_id, worker)
        except (KombuOperationalError, ConnectionError) as e:
            countdown = _countdown(settings, 2 ** min(self.request.retries, 6))
            logger.warning("chunk of job %s: transient error, retry in %ss: %s", job_id, countdown, e)
            raise self.retry(exc=e, countdown=countdown) from e
        except (Reject, SpecBatchError):
            raise
        except Interrupted:     # the job was cancelled mid-batch: drop its rows now (see worker.cancel)
            dropped = _release_mine(settings, job_id, worker)
            logger.info("job %s cancelled: dropped %d request(s) this worker was generating", job_id,
                        len(dropped))
            raise _revoked(self) from None
        except Exception as e:
            fallback = self.after_target_failure(settings, job_id, worker, fallback, e)
    if foreign:
        here = f"this worker's {mask(settings.database_url)} (id {database_id(settings.database_url)})"
        raise self.pass_on(settings, job_id, passes, f"job {job_id} is in another database (id {database}) than {here}",
                           f"its requests stay pending there: `specbatch resume {job_id}` with that database's "
                           "SPECBATCH_DATABASE_URL sends them again")
    if report is None:
        logger.info("job %s cancelled: task of %d request(s) dropped unread", job_id, len(request_ids))
        raise _revoked(self)
    self.health.ok()
    if report.unstarted:  # warm shutdown: back to the queue, the finished part is skipped there
        raise Reject("worker shutting down", requeue=True)
    if report.held:  # another worker holds a lease on some: look again once it has expired
        raise self.retry(countdown=_countdown(settings, min(report.retry_after + 0.5,
                                                            settings.lease_seconds + 1.0)))
    return report.to_dict()
