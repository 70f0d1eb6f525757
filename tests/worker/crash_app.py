"""Tests only: a Celery app with our queue configuration and a slow task, no models.

Used to measure what each pool does with an in-flight task when the worker dies.
``celery -A tests.worker.crash_app worker ...`` with SPECBATCH_BROKER_URL set.
"""

from __future__ import annotations

import time

import redis
from celery import Celery

from specbatch.config import get_settings
from specbatch.worker.app import celery_config

settings = get_settings()
app = Celery("crashprobe", set_as_current=False)
app.conf.update({**celery_config(settings), "include": [], "task_default_queue": "crashprobe"})


@app.task(name="crashprobe.slow", acks_late=True, max_retries=3, default_retry_delay=1)
def slow(key: str, seconds: float) -> None:
    r = redis.Redis.from_url(settings.broker_url)
    r.incr(f"runs:{key}")
    time.sleep(seconds)
    r.incr(f"done:{key}")
