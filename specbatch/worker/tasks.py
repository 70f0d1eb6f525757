"""Thin Celery tasks: take ids, call ``process_chunk``, turn its report into ack / retry.

The engine is held once per worker process by ``EngineTask``. Under ``specbatch worker`` (prefork,
one spawned pool child, see ``specbatch.worker.runner``) the child loads it in
``worker_process_init`` and then tells the parent it is ready, so the worker consumes only once
its models are loaded; that handler may block for as long as loading takes because the app
raises ``worker_proc_alive_timeout``. Any other pool (``celery -A specbatch.worker.app worker
--pool solo``) loads it on first use.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from celery import Task, signals
from celery.exceptions import Reject
from kombu.exceptions import OperationalError as KombuOperationalError

from specbatch.config import get_settings
from specbatch.observability import tracing
from specbatch.observability import worker as observe
from specbatch.worker.app import TASK_NAME, app
from specbatch.worker.chunk import TRANSIENT_DB_ERRORS, process_chunk

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine

logger = logging.getLogger(__name__)

MAX_RETRIES = 100          # worker-lost resends + waits for held leases + transient errors, together
_ENGINE: dict[str, Engine] = {}   # "engine" -> the loaded Engine of this process


def engine_spec(conf: Any) -> dict[str, Any]:
    """What this worker holds: ``specbatch_engine`` from the app config, else the default pair."""
    spec = conf.get("specbatch_engine")
    if spec:
        return dict(spec)
    s = get_settings()
    return {"target": s.default_target, "drafts": [s.default_draft], "ngram": False,
            "device": s.device, "dtype": s.dtype, "batch_size": s.batch_size,
            "threads": s.threads or None}


def build_engine(spec: dict[str, Any]) -> Engine:
    """Load the engine for ``spec`` (tests wrap this to inject faults)."""
    from specbatch.engine import Engine
    from specbatch.engine.threads import configure_threads

    configure_threads(spec.get("threads"), get_settings().local_workers)   # before the first forward
    return Engine.load(spec["target"], drafts=list(spec.get("drafts") or ()), ngram=bool(spec.get("ngram")),
                       device=spec.get("device", "cpu"), dtype=spec.get("dtype", "float32"),
                       cache_dir=get_settings().cache_dir or None, batch_size=spec.get("batch_size") or "auto",
                       max_memory=spec.get("max_memory"))


def get_engine(conf: Any) -> Engine:
    if "engine" not in _ENGINE:
        _ENGINE["engine"] = build_engine(engine_spec(conf))
    return _ENGINE["engine"]


def get_observer(conf: Any) -> observe.Observer:
    """This process's metrics/traces hook (``specbatch_observe`` from ``specbatch worker``)."""
    spec, opts = engine_spec(conf), conf.get("specbatch_observe") or {}
    return observe.start(target=spec["target"], drafts=spec.get("drafts") or (), ngram=bool(spec.get("ngram")),
                         worker=opts.get("worker") or socket.gethostname(), metrics=bool(opts.get("metrics")),
                         batch_size=int(spec.get("batch_size") or 1))


def _write_ready(path: str | None, text: str) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
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
    try:
        get_engine(conf)
    except Exception as e:  # reported to the parent, which exits non-zero with this message
        logger.error("cannot load models: %s", e)
        _write_ready(ready, f"error\n{e}")
        return
    get_observer(conf)
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
    """Holds the loaded engine for the process; ids in, nothing out (results live in our tables)."""

    ignore_result = True
    acks_late = True
    max_retries = MAX_RETRIES
    default_retry_delay = 1   # the worker-lost resend; Task's own default is 180 s

    @property
    def engine(self) -> Engine:
        return get_engine(self.app.conf)


@app.task(bind=True, base=EngineTask, name=TASK_NAME)
def process_chunk_task(self: EngineTask, job_id: str, request_ids: list[int]) -> dict[str, Any]:
    """Generate the requests ``request_ids`` of job ``job_id``; see ``specbatch.worker.chunk``."""
    settings = get_settings()
    observer = get_observer(self.app.conf)
    try:
        with tracing.continued(tracing.headers_of(self.request), "chunk",
                               {"specbatch.job.id": job_id, "specbatch.request_ids": request_ids,
                                "specbatch.worker": _worker_name(self)}):
            report = process_chunk(settings, self.engine, request_ids, _worker_name(self),
                                   on_result=observer.on_result, should_stop=_should_stop)
    except TRANSIENT_DB_ERRORS + (KombuOperationalError, ConnectionError) as e:
        countdown = _countdown(settings, 2 ** min(self.request.retries, 6))
        logger.warning("chunk of job %s: transient error, retry in %ss: %s", job_id, countdown, e)
        raise self.retry(exc=e, countdown=countdown) from e
    if report.unstarted:  # warm shutdown: back to the queue, the finished part is skipped there
        raise Reject("worker shutting down", requeue=True)
    if report.held:  # another worker holds a lease on some: look again once it has expired
        raise self.retry(countdown=_countdown(settings, min(report.retry_after + 0.5,
                                                            settings.lease_seconds + 1.0)))
    return report.to_dict()
