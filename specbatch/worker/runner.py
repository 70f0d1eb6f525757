"""``specbatch worker``: one Celery worker process holding one model pair, consuming its queue.

Pool choice, measured here (celery 5.7.0, kombu 5.7.0, redis-server, one 8-30 s task in flight;
tests/worker/test_pool_crash.py keeps the SIGQUIT rows honest):

  pool                        signal              in-flight message right after      re-run
  solo                        SIGQUIT (cold)      queue 0, unacked 0: acked, GONE    never
  prefork, spawn, 1 child     SIGQUIT (cold)      queue 1: requeued at once          ~3 s, next worker
  solo                        SIGKILL             unacked 1                          after visibility_timeout
  prefork, spawn              SIGKILL pool child  parent resends it (worker lost)    ~1 s, new child
  prefork, spawn              SIGKILL parent      unacked 1                          after visibility_timeout

So a worker is prefork with exactly one spawned child: the child, a fresh interpreter, is the
only process that loads models or touches CUDA; the parent never forks a process that has.
The parent waits (``EngineReady`` bootstep, before the consumer starts) until the child reports
its models loaded, or exits non-zero with the loading error.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import bootsteps

from specbatch.config import Settings
from specbatch.errors import SpecBatchError
from specbatch.worker.app import create_app
from specbatch.worker.pids import alive
from specbatch.worker.queues import queue_name

logger = logging.getLogger(__name__)

EX_MODEL_LOAD = 3   # exit status when the models cannot be loaded


class ModelLoadFailed(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(EX_MODEL_LOAD)
        self.message = message


class EngineReady(bootsteps.StartStopStep):
    """Block worker start-up (after the pool, before the consumer) until the child has its models."""

    requires = ("celery.worker.components:Pool",)
    timeout = 3600.0

    def start(self, worker: Any) -> None:
        path = worker.app.conf.get("specbatch_ready_file")
        if not path:
            return
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    text = f.read()
            except FileNotFoundError:
                text = ""
            if text.startswith("ok"):
                logger.info("models loaded; consuming %s", ", ".join(worker.app.amqp.queues))
                return
            if text.startswith("error"):
                message = text.partition("\n")[2].strip()
                logger.error("cannot load models: %s", message)
                raise ModelLoadFailed(message)
            time.sleep(0.2)
        raise ModelLoadFailed(f"models not loaded after {self.timeout:.0f}s")


class LeaseSweeper(bootsteps.StartStopStep):
    """Once the models are loaded, sweep this worker's queue for requests a dead worker held
    (``specbatch.worker.heal``), at start and every ``lease_sweep_seconds``."""

    requires = (EngineReady,)

    def start(self, worker: Any) -> None:
        from specbatch.config import get_settings
        from specbatch.worker.heal import Sweeper

        queues = worker.app.conf.get("specbatch_sweep_queues")
        self.sweeper = Sweeper(get_settings(), queues) if queues else None
        if self.sweeper is not None:
            self.sweeper.start()

    def stop(self, worker: Any) -> None:
        sweeper = getattr(self, "sweeper", None)
        if sweeper is not None:
            sweeper.stop()


def worker_argv(queue: str, *, hostname: str | None, loglevel: str, pool: str = "prefork",
                start_method: str = "spawn", extra: Sequence[str] = ()) -> list[str]:
    argv = ["worker", "-Q", queue, "--loglevel", loglevel, "--pool", pool, "--concurrency", "1",
            "--prefetch-multiplier", "1", "-E", "--without-gossip", "--without-mingle",
            "--hostname", hostname or f"specbatch-{os.getpid()}@%h"]
    if pool == "prefork":
        argv += ["--pool-start-method", start_method]
    return argv + list(extra)


def run_worker(settings: Settings, *, target: str, drafts: Sequence[str] = (), ngram: bool = False,
               device: str | None = None, dtype: str | None = None, batch_size: int | str | None = None,
               max_memory: int | None = None, threads: int | None = None, compile: str | None = None,
               hostname: str | None = None, loglevel: str = "INFO", pool: str = "prefork",
               imports: Sequence[str] = (), extra_argv: Sequence[str] = (),
               metrics_port: int = 0) -> tuple[int, str | None]:
    """Run a worker until it stops; returns (exit status, the model loading error if any).

    ``imports``: extra modules the pool child imports (tests use it to inject faults).
    ``metrics_port``: serve Prometheus ``/metrics`` there (``specbatch.observability.metrics``).
    ``device``, ``dtype``, ``batch_size``, ``compile``: None takes the settings' value.
    """
    from celery.utils.nodenames import default_nodename, host_format

    queue = queue_name(target, drafts, ngram)
    hostname = hostname or f"specbatch-{os.getpid()}@%h"
    metrics_dir, server = _serve_metrics(settings, metrics_port)
    app = create_app(settings)
    own = worker_dir(settings)
    ready = str(own / "ready")
    app.conf.update(
        specbatch_engine={"target": target, "drafts": list(drafts), "ngram": ngram,
                          "device": device or settings.device, "dtype": dtype or settings.dtype,
                          "batch_size": batch_size or settings.batch_size, "max_memory": max_memory,
                          "threads": threads, "compile": compile or settings.compile},
        specbatch_ready_file=ready if pool == "prefork" else None,
        specbatch_observe={"worker": host_format(default_nodename(hostname)), "metrics": server is not None},
        imports=list(imports),
        task_default_queue=queue,
        specbatch_sweep_queues=[queue],
    )
    app.steps["worker"].add(EngineReady)
    app.steps["worker"].add(LeaseSweeper)
    if pool != "prefork":  # solo/threads: the models live in this process; load them before consuming
        from specbatch.worker import tasks

        try:
            tasks.get_engine(app.conf)
        except SpecBatchError as e:
            _stop_metrics(metrics_dir, server)
            return EX_MODEL_LOAD, str(e)
        tasks.get_observer(app.conf)
    code = 0
    try:
        app.worker_main(worker_argv(queue, hostname=hostname, loglevel=loglevel, pool=pool,
                                    extra=extra_argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        _stop_metrics(metrics_dir, server)
    load_error = None
    try:
        with open(ready) as f:
            text = f.read()
        if text.startswith("error"):
            load_error = text.partition("\n")[2].strip() or "unknown error"
    except FileNotFoundError:
        pass
    shutil.rmtree(own, ignore_errors=True)
    return code, load_error


def worker_dir(settings: Settings) -> Path:
    """This worker's own scratch directory (its readiness file), made empty; the directories of
    workers that no longer run (killed with SIGKILL: nothing cleaned up) are removed first."""
    base = Path(settings.ready_dir or tempfile.gettempdir()) / f"specbatch-{os.getuid()}" / "workers"
    base.mkdir(parents=True, exist_ok=True)
    for d in base.iterdir():
        if d.name.isdigit() and not alive(int(d.name)):
            shutil.rmtree(d, ignore_errors=True)
    own = base / str(os.getpid())
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir()
    return own



def _serve_metrics(settings: Settings, port: int) -> tuple[str, Any]:
    """A fresh multiprocess directory and the /metrics server of this worker (("", None) if off)."""
    if not port:
        return "", None
    from specbatch.observability import metrics

    directory = metrics.prepare_multiprocess()   # before the pool child exists: it inherits it
    try:
        return directory, metrics.serve(port, settings.metrics_address, directory)
    except OSError as e:
        shutil.rmtree(directory, ignore_errors=True)
        raise SpecBatchError(f"cannot serve metrics on {settings.metrics_address}:{port}: {e.strerror or e}; "
                             "choose another --metrics-port") from e


def _stop_metrics(directory: str, server: Any) -> None:
    if server is not None:
        server.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
