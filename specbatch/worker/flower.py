"""The app Flower runs on (``specbatch flower``, ``celery -A specbatch.worker.flower flower``).

Flower's Broker tab lists the queues live workers consume, or, with none, the app's default
queue: the pair queues (``specbatch.worker.queues``) are made on first use, so a job's waiting
tasks sat in a queue the tab did not list. Here the tab also lists every ``specbatch.*`` queue the
broker has a binding for (kombu's Redis transport keeps one set per exchange; a pair queue's
exchange is named after it), with its message count as Flower reads it. (Its broker URL is masked where it has a password,
only then, by the app's connection class: ``worker.app.ShownConnection``.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

from specbatch.config import Settings, get_settings
from specbatch.worker.app import create_app
from specbatch.worker.queues import PREFIX

logger = logging.getLogger(__name__)


def broker_queues(app: Any) -> list[str]:
    """The ``specbatch.*`` queues bound in the broker (Redis); [] for other brokers or on error."""
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            keyprefix, sep = getattr(channel, "keyprefix_queue", None), getattr(channel, "sep", None)
            client = getattr(channel, "client", None)
            if keyprefix is None or sep is None or client is None:   # not Redis
                return []
            names = set()
            for key in client.scan_iter(match=keyprefix % f"{PREFIX}.*"):
                for member in client.smembers(key):
                    queue = (member.decode() if isinstance(member, bytes) else member).split(sep)[-1]
                    if queue.startswith(f"{PREFIX}."):
                        names.add(queue)
            return sorted(names)
    except Exception as e:   # Flower shows what it has; the broker tab logs its own errors too
        logger.warning("cannot list the broker's queues: %s", e)
        return []


def _list_broker_queues_too() -> None:
    """Flower's handlers ask ``get_active_queue_names`` which queues to count (flower 2.x)."""
    try:
        from flower.views import BaseHandler
    except ImportError:   # not the Flower process's concern then
        return
    original = getattr(BaseHandler, "get_active_queue_names", None)
    if original is None or getattr(original, "_specbatch", False):
        return

    def get_active_queue_names(self: Any) -> list[str]:
        return sorted(set(original(self)) | set(broker_queues(self.capp)))

    get_active_queue_names._specbatch = True   # type: ignore[attr-defined]
    BaseHandler.get_active_queue_names = get_active_queue_names


def _basic_auth(settings: Settings) -> None:
    """SPECBATCH_FLOWER_PASSWORD as Flower's own FLOWER_BASIC_AUTH, which Flower reads from the
    environment after importing this app: `celery -A specbatch.worker.flower flower` (README's
    second way) asks for the password too, not only `specbatch flower`. One given explicitly wins."""
    if settings.flower_password:
        os.environ.setdefault("FLOWER_BASIC_AUTH", f"{settings.flower_user}:{settings.flower_password}")


app = create_app(get_settings())
_basic_auth(get_settings())
_list_broker_queues_too()
