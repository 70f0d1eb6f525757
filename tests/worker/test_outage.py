"""Circuit breaker: the database goes down mid-job for longer than a lease, then comes back.
The worker pauses (stops consuming, says so), probes with back-off, resumes by itself, and the job
completes with exactly one result per request, none failed by the outage."""

from __future__ import annotations

import time

import pytest

from specbatch.worker.monitor import active_queues
from tests.worker.private_pg import PrivatePostgres
from tests.worker.services import wait_for

# slow: 40 requests through a worker that pauses and resumes, ~4 min on 2 busy cores; .ci/run runs it
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_database_outage_longer_than_a_lease(cluster, monkeypatch) -> None:  # noqa: ANN001
    pg = PrivatePostgres().init()
    try:
        cluster.env.update(SPECBATCH_DATABASE_URL=pg.url, SPECBATCH_BREAKER_MAX_BACKOFF="2",
                           SPECBATCH_CHUNK_SIZE="4")
        monkeypatch.setenv("SPECBATCH_DATABASE_URL", pg.url)
        lease = cluster.settings.lease_seconds
        worker = cluster.worker("w1")
        # two short requests finish first; the long rest is still decoding when the database goes
        # (a job of short ones alone can finish before it does: a large first batch is quick)
        rows = [{"custom_id": f"r{i}", "prompt": f"count {i}", "max_tokens": 4 if i < 2 else 256}
                for i in range(40)]
        job_id, ids = cluster.submit(rows)
        wait_for(lambda: cluster.summary(job_id)["request_counts"]["completed"] >= 2, 120, "first results")
        from specbatch.db import forget_engines

        forget_engines()
        pg.stop()
        down_at = time.monotonic()
        wait_for(lambda: "paused: not consuming" in worker.output(), 60, "the worker to pause")
        queue = cluster.queue()
        consuming = active_queues(cluster.settings, timeout=1.0) or {}
        assert not any(queue in qs for qs in consuming.values()), consuming   # visible to Flower
        time.sleep(max(0.0, lease + 2 - (time.monotonic() - down_at)))       # outlive every lease
        pg.start()
        summary = cluster.wait_finished(job_id, timeout=180)
        assert summary["status"] == "completed", summary
        rows_ = cluster.rows(job_id)
        assert [r["results"] for r in rows_] == [1] * len(ids)
        assert all(r["status"] == "completed" and r["error"] is None for r in rows_)
        out = worker.output()
        assert "breaker closed: the database is back" in out and "consuming" in out
        # back-off, not a hot loop: a handful of probes for an outage of a few seconds
        assert out.count("still down") <= 10, out.count("still down")
    finally:
        from specbatch.db import forget_engines

        forget_engines()
        pg.destroy()
