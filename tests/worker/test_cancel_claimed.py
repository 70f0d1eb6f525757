"""``cancel`` reaches the rows a worker is already generating: they are dropped at its next decoding
step (no result stored for them, status cancelled) instead of running to their end. Real
redis-server, a real worker, tiny models; one task holds the whole job."""

from __future__ import annotations

import re

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
    before = cluster.rows(job_id)
    result = CliRunner().invoke(cli, ["cancel", job_id])
    assert result.exit_code == 0, result.output
    # cancel waits for the worker (it looks every second) and reports from the rows what became of
    # the requests it held: dropped, or finished first
    said = re.fullmatch(rf"job {job_id} cancelled: (\d+) pending requests? dropped; (\d+) running requests? dropped "
                        r"at the next decoding step, (\d+) finished first\n", result.output)
    assert said, result.output
    assert cluster.summary(job_id)["status"] == "cancelled"
    final = cluster.rows(job_id)
    dropped = [r for r in final if r["status"] == "cancelled"]
    pending_dropped, running_dropped, finished_first = map(int, said.groups())
    assert running_dropped >= 1 and pending_dropped + running_dropped == len(dropped), (result.output, final)
    assert finished_first <= sum(r["status"] == "completed" for r in final) - \
        sum(r["status"] == "completed" for r in before), (result.output, before, final)
    assert dropped and all(r["results"] == 0 for r in dropped), final
    assert all(r["results"] == 1 for r in final if r["status"] == "completed"), final
    assert "cancelled: dropped" in w1.output()
