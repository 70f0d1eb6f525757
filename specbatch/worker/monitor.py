"""Ask the live workers (Celery remote control) which queues they consume."""

from __future__ import annotations

import logging

from specbatch.config import Settings
from specbatch.worker.app import app_for

logger = logging.getLogger(__name__)


def active_queues(settings: Settings, timeout: float = 1.0) -> dict[str, list[str]] | None:
    """worker name -> queue names it consumes; None when the broker is unreachable."""
    app = app_for(settings)
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
            replies = app.control.inspect(timeout=timeout, connection=conn).active_queues() or {}
    except Exception as e:
        logger.debug("broker unreachable: %s", e)
        return None
    return {worker: [q.get("name", "") for q in (queues or [])] for worker, queues in replies.items()}


def queue_has_consumer(settings: Settings, queue: str, timeout: float = 1.0) -> bool | None:
    """Whether a live worker consumes ``queue``; None when the broker cannot be reached."""
    workers = active_queues(settings, timeout=timeout)
    if workers is None:
        return None
    return any(queue in names for names in workers.values())
