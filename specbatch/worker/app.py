"""The Celery app, built from Settings only (``celery -A specbatch.worker.app worker|flower``).

Everything the queue promises is configuration here:
- JSON only, no result backend (results live in our tables), task events on for Flower;
- late acks + prefetch 1: a message leaves Redis only once its chunk is done;
- a worker process that dies mid-task (pool child killed, poison request) gets the task sent
  again (``task_retry_on_worker_lost``, Celery 5.7; bounded by the task's ``max_retries``;
  ``task_reject_on_worker_lost`` requeues it when that send fails);
- a whole worker that dies (SIGKILL, machine lost) leaves its message unacked in Redis, which
  restores it after ``visibility_timeout`` (a setting, above the longest chunk);
- ``worker_proc_alive_timeout`` is long because a pool child loads both models before it
  reports ready (see ``specbatch.worker.tasks``).
"""

from __future__ import annotations

import functools
import warnings
from operator import itemgetter
from typing import Any

import celery.app.amqp
from celery import Celery, signals
from celery.exceptions import CPendingDeprecationWarning
from kombu import Connection

from specbatch.config import Settings, get_settings
from specbatch.redact import mask_url

TASK_NAME = "specbatch.process_chunk"


def celery_config(settings: Settings) -> dict:
    """The Celery configuration for ``settings`` (plain data; the app adds nothing else)."""
    # Redis restores a dead worker's unacked messages once they are visibility_timeout old; kombu
    # only looks every interval * throttle seconds (100 s by default): look every vt / 10 instead.
    transport = {"visibility_timeout": settings.visibility_timeout, "unacked_restore_throttle": 1,
                 "unacked_restore_interval": max(1, min(60, settings.visibility_timeout // 10)),
                 # a broker that accepts TCP but never answers must not hang a call forever
                 "socket_connect_timeout": settings.broker_timeout,
                 "socket_timeout": settings.broker_timeout}
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": settings.broker_timeout,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_acks_on_failure_or_timeout": True,
        "task_reject_on_worker_lost": True,
        "task_retry_on_worker_lost": True,
        "task_default_retry_delay": 1,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_proc_alive_timeout": 900.0,
        "worker_hijack_root_logger": False,
        # a chunk keeps decoding through a broker loss (its rows are leased in our tables); its
        # message, restored unacked, runs again and skips the rows that are done or still leased
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_create_missing_queues": True,
        "task_default_queue": "specbatch.default",
        "include": ["specbatch.worker.tasks"],
    }


@signals.celeryd_after_setup.connect
def _quiet_the_settled_warning(**_: object) -> None:
    """Celery warns at every broker loss (10 lines in the worker's log) that the default of
    ``worker_cancel_long_running_tasks_on_connection_loss`` changes in Celery 6: it is set above.
    (After the worker's log setup, whose own filters show every Celery deprecation warning.)"""
    warnings.filterwarnings("ignore", message=r"\s*In Celery 5.1 we introduced an optional breaking change",
                            category=CPendingDeprecationWarning)


GETFIELDS = itemgetter("port", "userid", "password", "virtual_host", "transport")   # kombu's default


class ShownConnection(Connection):
    """kombu's Connection whose ``as_uri()`` (Celery's banner "transport: ...", its "Connected to
    ..." and "Cannot connect to ..." lines) masks only a password that is there: kombu's writes
    ``:**@`` into a URL with none at all (``redis://:**@127.0.0.1:6379/0``), which reads as if one
    were set. Masked by ``redact``, as every other line shows a URL."""

    def as_uri(self, include_password: Any = False, mask: Any = "**", getfields: Any = GETFIELDS) -> str:
        uri = super().as_uri(include_password=True, mask=mask, getfields=getfields)
        return uri if include_password else mask_url(uri)


class AMQP(celery.app.amqp.AMQP):
    Connection = ShownConnection


def create_app(settings: Settings) -> Celery:
    """A new Celery app configured from ``settings``."""
    app = Celery("specbatch", set_as_current=False, amqp=AMQP)
    app.conf.update(celery_config(settings))
    return app


@functools.lru_cache(maxsize=8)
def app_for(settings: Settings) -> Celery:
    """One app per settings value in this process (producers: enqueue, monitor)."""
    return create_app(settings)


app = create_app(get_settings())
