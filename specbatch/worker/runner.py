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

Starting: the parent's consumer starts at once but consumes no task queue (``HoldQueue``), so
the worker is online (heartbeats, Flower, ``celery inspect``) while the child loads; its state
(``specbatch_state`` in the app config: "starting: loading models", then the child's own, e.g.
"compiling 2/4 (...), decoding eagerly until then") is what ``specbatch status`` / ``submit``
show. The ``EngineReady`` consumer step consumes the queue once the child reports its models
loaded, or exits non-zero with the loading error. Compiling happens after that, in the child's
background (``specbatch.engine.background``), so the worker serves eagerly meanwhile.
SIGTERM at any moment of the start-up exits 0: before Celery installs its handler,
``stop_on_sigterm``'s ends the start-up where it is; after, the warm shutdown kills a child still
loading (``StopLoadingChild``: it cannot see the shutdown while it loads, and billiard would wait
for it).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import shutil
import signal
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import bootsteps

from specbatch.config import Settings
from specbatch.engine.drafter_specs import names, parse_drafters
from specbatch.errors import SpecBatchError
from specbatch.worker.app import create_app
from specbatch.worker.monitor import DATABASE_KEY, STARTING, STATE_KEY
from specbatch.worker.queues import queue_name
from specbatch.worker.scratch import STATE_FILE, read_worker, scratch_dirs, source, workers_root, write_worker

logger = logging.getLogger(__name__)

EX_MODEL_LOAD = 3   # exit status when the models cannot be loaded


class ModelLoadFailed(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(EX_MODEL_LOAD)
        self.message = message


POLL_SECONDS = 0.5


def _read(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


class HoldQueue(bootsteps.Step):
    """Consume nothing at first: the consumer starts at once (the worker is online, answers
    inspect, sends heartbeats: Flower and ``specbatch status`` see it starting) and
    ``EngineReady`` adds the pair's queue once the pool child has its models."""

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        if worker.app.conf.get("specbatch_ready_file"):
            worker.app.amqp.queues.deselect(worker.app.conf.task_default_queue)


class EngineReady(bootsteps.StartStopStep):
    """In the consumer's event loop: follow the pool child's state file (``specbatch_state``
    in the app config), consume the queue once it reports its models loaded, exit with the
    loading error if it reports one. (A shutdown before then: ``StopLoadingChild``.)"""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.ready = False
        self.timer: Any = None

    def start(self, c: Any) -> None:
        if not c.app.conf.get("specbatch_ready_file"):
            return
        if not self.ready:   # the banner's [queues] is empty until then
            logger.info("online; consuming %s once the pool child has loaded the models",
                        c.app.conf.task_default_queue)
        self.poll(c)
        self.timer = c.timer.call_repeatedly(POLL_SECONDS, self.poll, (c,))

    def poll(self, c: Any) -> None:
        conf = c.app.conf
        state = _read(conf.get("specbatch_state_file")).strip()
        if state and state != conf.get(STATE_KEY):
            conf[STATE_KEY] = state
            logger.info("state: %s", state)
        if self.ready:
            return
        text = _read(conf.get("specbatch_ready_file"))
        if text.startswith("ok"):
            self.ready = True
            queue = conf.task_default_queue
            c.add_task_queue(queue)
            logger.info("models loaded; consuming %s", queue)
        elif text.startswith("error"):
            message = text.partition("\n")[2].strip()
            logger.error("cannot load models: %s", message)
            raise ModelLoadFailed(message)   # SystemExit: out of the event loop, the worker stops

    def stop(self, c: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class StopLoadingChild(bootsteps.StartStopStep):
    """At the worker's stop, before the pool's (it requires the pool; the consumer starts after
    every other step): kill the pool child if it still loads its models. It does not see a warm
    shutdown while it loads, and billiard would wait for it. Not a consumer step: a SIGTERM after
    Celery installed its handler but before the consumer started (the child already spawned) skips
    the consumer steps' stop, and the worker waited for the loading child forever."""

    requires = ("celery.worker.components:Pool",)

    def stop(self, worker: Any) -> None:
        ready = worker.app.conf.get("specbatch_ready_file")
        if not ready or _read(ready):   # solo, or the child has said how its loading ended
            return
        for pid in (getattr(worker.pool, "info", None) or {}).get("processes", ()):
            logger.info("stopping pool child %s while it loads its models", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    terminate = stop     # a cold shutdown


class LeaseSweeper(bootsteps.StartStopStep):
    """Sweep this worker's queue for requests a dead worker held (``specbatch.worker.heal``), at
    start and every ``lease_sweep_seconds``. It runs while the models still load: what it takes
    back is queued again, for whichever worker of the queue consumes first."""

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


def _database_id(settings: Settings) -> str | None:
    """The id of the database this worker reads (``db.database_id``), which its remote control
    answers with: `status` and `submit` of another database then say so (``cli.common.
    check_queue_workers``). None where it cannot be read now: the worker waits for a database that
    is down when its first task comes (worker.breaker)."""
    from sqlalchemy.exc import SQLAlchemyError

    from specbatch.db import database_id

    try:
        return database_id(settings.database_url)
    except (SQLAlchemyError, SpecBatchError):
        return None


def run_worker(settings: Settings, *, target: str, drafts: Sequence[str] = (),
               device: str | None = None, dtype: str | None = None, batch_size: int | str | None = None,
               max_memory: int | None = None, threads: int | None = None, compile: str | None = None,
               prefix_cache: bool | None = None, hostname: str | None = None, loglevel: str = "INFO", pool: str = "prefork",
               imports: Sequence[str] = (), extra_argv: Sequence[str] = (),
               metrics_port: int = 0) -> tuple[int, str | None]:
    """Run a worker until it stops; returns (exit status, the model loading error if any).

    ``drafts``: the pool's drafter specs as strings (``drafter_specs``; ``Pair.drafts``).
    ``imports``: extra modules the pool child imports (tests use it to inject faults).
    ``metrics_port``: serve Prometheus ``/metrics`` there (``specbatch.observability.metrics``).
    ``device``, ``dtype``, ``batch_size``, ``compile``, ``prefix_cache``: None takes the settings' value.
    """
    stop_on_sigterm()
    drafts = names(parse_drafters(drafts))
    queue = queue_name(target, drafts)
    hostname = hostname or default_hostname()
    metrics_dir, server = _serve_metrics(settings, metrics_port)
    own = worker_dir(settings)
    ready = str(own / "ready")
    code, load_error = 0, None
    try:
        app = create_app(settings)
        node = node_name(hostname)
        # `status` on this machine reads it when remote control does not answer in time (monitor.starting_here)
        write_worker(own, node, queue, settings)
        app.conf.update(
            specbatch_state_file=str(own / STATE_FILE) if pool == "prefork" else None,
            specbatch_state=STARTING if pool == "prefork" else "ready",
            **{DATABASE_KEY: _database_id(settings)},
            specbatch_engine={"target": target, "drafts": drafts,
                              "device": device or settings.device, "dtype": dtype or settings.dtype,
                              "batch_size": batch_size or settings.batch_size, "max_memory": max_memory,
                              "threads": threads, "compile": compile or settings.compile,
                              "prefix_cache": settings.prefix_cache if prefix_cache is None else prefix_cache},
            specbatch_ready_file=ready if pool == "prefork" else None,
            specbatch_observe={"worker": node, "metrics": server is not None},
            imports=list(imports),
            task_default_queue=queue,
            specbatch_sweep_queues=[queue],
        )
        app.steps["worker"].add(HoldQueue)
        app.steps["worker"].add(StopLoadingChild)
        app.steps["worker"].add(LeaseSweeper)
        app.steps["consumer"].add(EngineReady)
        if pool != "prefork":  # solo/threads: the models live in this process; load them before consuming
            from specbatch.worker import tasks

            task = app.tasks[tasks.TASK_NAME]   # this app's instance holds the engine (tasks.EngineTask)
            try:
                task.prepare()
            except SpecBatchError as e:
                code, load_error = EX_MODEL_LOAD, str(e)
        if load_error is None:
            app.worker_main(worker_argv(queue, hostname=hostname, loglevel=loglevel, pool=pool,
                                        extra=extra_argv))
    except SystemExit as e:     # Celery's exit, or a SIGTERM before its handler (stop_on_sigterm)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        _stop_metrics(metrics_dir, server)
    try:
        with open(ready) as f:
            text = f.read()
        if text.startswith("error"):
            load_error = text.partition("\n")[2].strip() or "unknown error"
    except FileNotFoundError:
        pass
    shutil.rmtree(own, ignore_errors=True)
    # the process ends next: the interpreter's last full garbage collections took 5-6 s of a
    # SIGTERM'd worker's exit on a busy 2-core host (gdb: gc_collect_main in Py_FinalizeEx);
    # frozen objects are not scanned again
    gc.freeze()
    return code, load_error


def _exit_on_sigterm(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def stop_on_sigterm() -> None:
    """Until Celery installs its own SIGTERM handler (its warm shutdown, once the worker starts),
    a SIGTERM ends the start-up where it is: SystemExit(0), so ``run_worker`` cleans up and the
    process exits 0. The default action killed it outright (exit -15, no output, its scratch
    directory left announcing "starting"): a worker stopped as soon as it announced itself died so
    at load 10, where Celery took seconds more to install its handler. No pool child exists before
    then (the pool starts after the handler), so there is none to stop."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def default_hostname() -> str:
    """``-n``'s default: ``specbatch-PID@%h``, one name per worker process."""
    return f"specbatch-{os.getpid()}@%h"


def node_name(hostname: str) -> str:
    """The node name Celery gives ``-n hostname`` (``gpu0@%h`` -> ``gpu0@thishost``)."""
    from celery.utils.nodenames import default_nodename, host_format

    return host_format(default_nodename(hostname))


def check_unique_name(settings: Settings, hostname: str) -> None:
    """Refuse a worker named as one that runs on this machine on the same broker and database
    (``-n gpu0@%h`` started twice): Celery warns of that only through mingle, which is off, and
    remote control then reaches both by one name (one pausing its queue pauses both); Flower shows
    one row for two. Read from the scratch directories (``scratch``), so before the broker answers."""
    node, here = node_name(hostname), source(settings)
    for d, running in scratch_dirs(settings):
        other = read_worker(d) if running and d.name != str(os.getpid()) else None
        if other is not None and other.name == node and other.source == here:
            raise SpecBatchError(f"a worker named {node} already runs on this machine (pid {d.name}), on the "
                                 "same broker and database; give this one another name (-n NAME@%h)")


def worker_dir(settings: Settings) -> Path:
    """This worker's own scratch directory (its readiness file), made empty; the directories of
    workers that no longer run (killed with SIGKILL: nothing cleaned up) are removed first."""
    for d, running in scratch_dirs(settings):
        if not running:
            shutil.rmtree(d, ignore_errors=True)
    own = workers_root(settings) / str(os.getpid())
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir(parents=True)
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
        # an address that does not resolve, or is not this machine's, is the address's fault, not the port's
        fix = "check SPECBATCH_METRICS_ADDRESS (an address of this machine, e.g. 0.0.0.0 or 127.0.0.1)" \
            if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL else "choose another --metrics-port"
        raise SpecBatchError(f"cannot serve metrics on {settings.metrics_address}:{port}: {e.strerror or e}; "
                             f"{fix}") from e


def _stop_metrics(directory: str, server: Any) -> None:
    if server is not None:
        server.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
