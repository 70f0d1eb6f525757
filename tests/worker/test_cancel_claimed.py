"""``cancel`` reaches the rows a worker is already generating: they are dropped at its next decoding
step (no result stored for them, status cancelled) instead of running to their end. Real
redis-server, a real worker, tiny models; one task holds the whole job."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from tests.worker.services import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_cancel_drops_rows_the_worker_is_generating(cluster, monkeypatch) -> None:  # noqa: ANN001
    cluster.env["SPECBATCH_CHUNK_SIZE"] = "8"
    # slow steps: on a quiet machine the tiny model ended all six rows within the cancel watch's
    # first second, and the test saw nothing to drop
    w1 = cluster.worker("w1", imports=("tests.worker.slow_step_hook",))
    rows = [{"custom_id": f"q{i}", "prompt": f"Tell a long story {i}", "max_tokens": 450} for i in range(6)]
    job_id, ids = cluster.submit(rows)
    wait_for(lambda: sum(r["status"] == "running" and r["attempts"] > 0 for r in cluster.rows(job_id)) >= 1,
             90, "rows to decode", interval=0.05)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["cancel", job_id])
    assert result.exit_code == 0, result.output
    assert "a worker drops" in result.output or "cancelled:" in result.output, result.output
    wait_for(lambda: cluster.summary(job_id)["status"] == "cancelled", 60, "the job to be cancelled", interval=0.2)
    final = cluster.rows(job_id)
    dropped = [r for r in final if r["status"] == "cancelled"]
    assert dropped and all(r["results"] == 0 for r in dropped), final
    assert all(r["results"] == 1 for r in final if r["status"] == "completed"), final
    assert "cancelled: dropped" in w1.output()
