"""Leases heal on their own: a worker SIGKILLed mid-job leaves its requests running with leases
that expire; a live worker queues them again by itself, long before Redis would redeliver the
dead worker's message (the visibility timeout here is an hour). Real redis-server, real workers."""

from __future__ import annotations

import os
import signal

import pytest

from tests.worker.services import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _rows(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"q{i}", "prompt": f"The quick brown fox {i}", "max_tokens": max_tokens} for i in range(n)]


def test_a_killed_workers_requests_are_queued_again_by_a_live_worker(cluster) -> None:  # noqa: ANN001
    # Redis would give the dead worker's message back only after an hour: healing must not wait for it
    cluster.env.update({"SPECBATCH_VISIBILITY_TIMEOUT": "3600", "SPECBATCH_LEASE_SWEEP_SECONDS": "1",
                        "SPECBATCH_MAX_ATTEMPTS": "3"})
    # slow steps (tests/worker/test_queue_integration.py, SLOW_STEPS): the tiny model ends these rows
    # at 37-124 tokens, a chunk in 0.1-0.3 s, which a loaded poller could miss, or see just before
    # the chunk ended and leave nothing stranded to heal
    w1 = cluster.worker("w1", imports=("tests.worker.slow_step_hook",))
    # one task (SPECBATCH_CHUNK_SIZE=2): no other task of the job is left for a worker to claim the
    # stranded rows along with its own
    job_id, ids = cluster.submit(_rows(2, max_tokens=300))
    wait_for(lambda: any(r["status"] == "running" for r in cluster.rows(job_id)), 90, "a request to run",
             interval=0.1)
    os.killpg(w1.pid, signal.SIGKILL)
    w1.wait(10)
    stranded = [r for r in cluster.rows(job_id) if r["status"] == "running"]
    assert stranded, cluster.rows(job_id)
    w2 = cluster.worker("w2")
    summary = cluster.wait_finished(job_id, timeout=180)
    assert summary["status"] == "completed", summary
    assert all(r["results"] == 1 for r in cluster.rows(job_id)), cluster.rows(job_id)
    assert "whose worker died (lease expired) queued again" in w2.output()
