"""The remote-control command behind ``monitor.queue_workers``: which queues a worker consumes and
how far along it is, in one reply, so ``specbatch status`` and ``submit`` ask the workers once.

Each broadcast waits its full timeout for replies (no one knows how many workers will answer);
the built-in ``active_queues`` and ``conf`` were two of them, two seconds of every ``status``.
Importing this module registers the command in Celery's global panel: every worker imports it
with ``specbatch.worker.tasks`` (the app's ``include``).
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command

from specbatch.worker.monitor import DATABASE_KEY, STATE_KEY, VIEW_COMMAND


@inspect_command(name=VIEW_COMMAND)
def specbatch_view(state: Any) -> dict[str, Any]:
    """{"queues": the queues consumed now, "default_queue": the worker's own pair queue (consumed
    once its models are loaded), "state": its ``specbatch_state`` or None, "database": the id of
    the database it reads or None}."""
    consumer = state.consumer.task_consumer
    conf = state.app.conf
    return {"queues": [q.name for q in consumer.queues] if consumer else [],
            "default_queue": conf.task_default_queue, "state": conf.get(STATE_KEY),
            "database": conf.get(DATABASE_KEY)}
