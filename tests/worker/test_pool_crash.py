"""The measurement behind the pool choice (specbatch.worker.runner): what happens to the in-flight
message when a worker gets SIGQUIT (cold shutdown), per pool. No models: tests.worker.crash_app."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from celery import Celery

from tests.worker.services import REPO, Proc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("pool, requeued", [("solo", False), ("prefork", True)])
def test_cold_shutdown_mid_task(pool: str, requeued: bool, redis_server, tmp_path: Path) -> None:  # noqa: ANN001
    env = {**os.environ, "SPECBATCH_BROKER_URL": redis_server.url, "PYTHONPATH": str(REPO),
           "SPECBATCH_VISIBILITY_TIMEOUT": "60"}
    argv = [sys.executable, "-m", "celery", "-A", "tests.worker.crash_app", "worker", "-Q", "crashprobe",
            "--concurrency", "1", "--without-gossip", "--without-mingle", "--pool", pool]
    if pool == "prefork":
        argv += ["--pool-start-method", "spawn"]
    worker = Proc(argv, env, tmp_path / "worker.log")
    try:
        producer = Celery("p", broker=redis_server.url, set_as_current=False)
        producer.send_task("crashprobe.slow", args=("k", 30.0), queue="crashprobe", serializer="json")
        client = redis_server.client()
        wait_for(lambda: client.get("runs:k"), 60, "the task to start")
        worker.signal(signal.SIGQUIT)
        worker.wait(30)
        in_queue, unacked = client.llen("crashprobe"), client.hlen("unacked")
    finally:
        worker.stop()
    if requeued:   # prefork (spawn): the message is back in the queue at once
        assert (in_queue, unacked) == (1, 0), worker.output()[-2000:]
    else:          # solo: acknowledged on the way out, gone from Redis: the chunk is lost
        assert (in_queue, unacked) == (0, 0), worker.output()[-2000:]
