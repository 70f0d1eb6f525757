"""A broker that lost its tasks (FLUSHALL here, as after a Redis restart without its append-only
file) leaves requests queued in the database with nothing to run them. `status` says so, and the
live workers of the queue queue them again by themselves, once between them: each request is
generated and stored once. Real redis-server, real workers, tiny models."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import redis

from tests.worker.conftest import CLI

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_requests_the_broker_lost_are_queued_again_once_by_the_live_workers(cluster) -> None:  # noqa: ANN001
    cluster.env.update({"SPECBATCH_LEASE_SWEEP_SECONDS": "1", "SPECBATCH_CHUNK_SIZE": "2"})
    rows = [{"custom_id": f"q{i}", "prompt": f"The quick brown fox {i}", "max_tokens": 4} for i in range(6)]
    job_id, ids = cluster.submit(rows)
    client = redis.Redis.from_url(cluster.redis.url)
    assert client.llen(cluster.queue()) == 3
    client.flushall()                                   # every task of the job is gone
    time.sleep(1.5)          # past the grace a just-submitted request gets (lease_sweep_seconds)
    status = subprocess.run([*_cli(), "status", job_id], env=cluster.env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    assert "6 requests stranded: 6 queued requests with no task in the broker" in status.stderr, status.stderr
    assert "being recovered" in status.stderr

    w1, w2 = cluster.worker("w1"), cluster.worker("w2")
    summary = cluster.wait_finished(job_id, timeout=180)
    assert summary["status"] == "completed", summary
    assert all(r["results"] == 1 for r in cluster.rows(job_id)), cluster.rows(job_id)
    requeued = [int(n) for w in (w1, w2)
                for n in re.findall(r"(\d+) queued request\(s\) had no task in the broker", w.output())]
    assert sum(requeued) == len(ids), requeued       # queued again once, by one worker or the other
    status = subprocess.run([*_cli(), "status", job_id], env=cluster.env, capture_output=True, text=True,
                            timeout=60)
    assert "stranded" not in status.stderr, status.stderr


def test_requests_lost_behind_a_later_jobs_tasks_are_found_and_run_once(cluster) -> None:  # noqa: ANN001
    """The broker restarts empty and a new job is submitted at once: the queue is busy with the new
    job's tasks while the old job's are gone. `status` names the old job's stranded requests, and a
    worker recovers them before the queue drains."""
    cluster.env.update({"SPECBATCH_LEASE_SWEEP_SECONDS": "1", "SPECBATCH_CHUNK_SIZE": "2"})
    old_job, old_ids = cluster.submit([{"custom_id": f"o{i}", "prompt": f"Old text {i}", "max_tokens": 4}
                                       for i in range(4)])
    redis.Redis.from_url(cluster.redis.url).flushall()
    new_job, new_ids = cluster.submit([{"custom_id": f"n{i}", "prompt": f"New text {i}", "max_tokens": 4}
                                       for i in range(6)])
    time.sleep(1.5)
    status = subprocess.run([*_cli(), "status", old_job], env=cluster.env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    assert "4 requests stranded: 4 queued requests with no task in the broker" in status.stderr, status.stderr
    status = subprocess.run([*_cli(), "status", new_job], env=cluster.env, capture_output=True, text=True,
                            timeout=60)
    assert "stranded" not in status.stderr, status.stderr

    worker = cluster.worker("w1")
    for job_id in (old_job, new_job):
        assert cluster.wait_finished(job_id, timeout=180)["status"] == "completed"
        assert all(r["results"] == 1 for r in cluster.rows(job_id)), cluster.rows(job_id)
    requeued = [int(n) for n in re.findall(r"(\d+) queued request\(s\) had no task in the broker", worker.output())]
    assert sum(requeued) == len(old_ids), requeued


def _cli() -> list[str]:
    return list(CLI)
