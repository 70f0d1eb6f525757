"""A worker never generates with the wrong model or for another database, and a worker whose
target keeps failing stops claiming (#16 item 7, circuit breaker: target failures)."""

from __future__ import annotations

import sys

import pytest

from specbatch.worker.monitor import active_queues
from tests.worker.services import Proc, wait_for

pytestmark = pytest.mark.integration
ROWS = [{"custom_id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 4} for i in range(4)]


def _queue_len(cluster, queue: str) -> int:  # noqa: ANN001
    return int(cluster.redis.client().llen(queue))


def _consumes(cluster, worker: str, queue: str) -> bool:  # noqa: ANN001
    workers = active_queues(cluster.settings, timeout=0.5) or {}
    return any(queue in qs for name, qs in workers.items() if name.startswith(worker))


def _wait_refused(cluster, proc: Proc, worker: str, queue: str, reason: str) -> None:  # noqa: ANN001
    wait_for(lambda: "REFUSED" in proc.output() and reason in proc.output(), 120,
             f"{worker} to refuse ({reason})")
    wait_for(lambda: not _consumes(cluster, worker, queue), 30, f"{worker} to stop consuming {queue}")
    wait_for(lambda: _queue_len(cluster, queue) >= 1, 30, "the refused task back in its queue")


def test_wrong_model_and_wrong_database_are_refused_then_the_right_worker_finishes(
        cluster, tmp_path, pg_database, monkeypatch) -> None:  # noqa: ANN001
    # PostgreSQL: the "other database" is then another server-side database, as in a real mix-up
    cluster.env["SPECBATCH_DATABASE_URL"] = pg_database
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", pg_database)
    job_id, _ = cluster.submit(ROWS)
    queue = cluster.queue()
    # 1. a plain celery worker on this pair's queue: it would hold the default pair
    plain = Proc([sys.executable, "-m", "celery", "-A", "specbatch.worker.app", "worker", "-Q", queue,
                  "--pool", "solo", "-n", "plain@%h", "--without-gossip", "--without-mingle", "-l", "INFO"],
                 cluster.env, tmp_path / "plain.log")
    cluster.procs.append(plain)
    _wait_refused(cluster, plain, "plain@", queue, "this worker holds smollm2-135m + smollm2-135m-int8")
    assert "Loading weights" not in plain.output()        # refused before loading anything
    plain.stop()
    # 2. the right pair, but another database: not this worker's task, and no sign that this worker
    # is the misconfigured one, so it is passed on for a worker of that database, the queue still
    # consumed (docs/DESIGN.md, "Tasks of another database")
    other_env = {**cluster.env, "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'other.db'}"}
    argv = [sys.executable, "-c", "from specbatch.cli.main import main; main()", "worker",
            "--target", str(cluster.models / "llama"), "--draft", str(cluster.models / "llama-partial"),
            "-n", "otherdb@%h"]
    other = Proc(argv, other_env, tmp_path / "otherdb.log")
    cluster.procs.append(other)
    wait_for(lambda: "REFUSED" in other.output() and "is in another database" in other.output(), 120,
             "otherdb@ to pass the task on")
    assert _consumes(cluster, "otherdb@", queue), other.output()[-3000:]
    # and `status` of the job's database names it as a worker of another database
    import subprocess

    from tests.worker.conftest import CLI

    status = subprocess.run([*CLI, "status", job_id], env=cluster.env, capture_output=True, text=True, timeout=60)
    assert "worker otherdb@" in status.stderr and "reads another database" in status.stderr, status.stderr
    other.stop()
    assert {r["status"] for r in cluster.rows(job_id)} == {"pending"}  # nothing generated or failed
    # 3. the right worker finishes it; every result records its models
    cluster.worker("right")
    summary = cluster.wait_finished(job_id)
    assert summary["status"] == "completed", summary
    from specbatch.db import session_factory
    from specbatch.db.models import Result

    with session_factory(cluster.settings.database_url).begin() as s:
        results = s.query(Result).filter_by(job_id=job_id).all()
        assert len(results) == len(ROWS)
        assert {r.target for r in results} == {str(cluster.models / "llama")}
        assert all(r.drafts == [str(cluster.models / "llama-partial")] and r.lossy is False for r in results)
        # and how it was decoded, for `specbatch audit` to re-decode it alike (results.numerics)
        import torch

        assert {(r.numerics["device"], r.numerics["dtype"], r.numerics["torch"]) for r in results} == {
            ("cpu", "float32", torch.__version__)}, results[0].numerics
        assert all(r.numerics["processor"] for r in results)


def test_a_task_of_another_database_holds_up_no_job_of_this_one(cluster, tmp_path) -> None:  # noqa: ANN001
    """A job submitted with another SPECBATCH_DATABASE_URL than the workers' put a task on their
    queue that every worker refused, pausing its queue: the jobs of the workers' own database
    waited behind it until someone purged the broker (qa53). The worker passes it on and goes on
    with its own database's work."""
    from specbatch import db
    from specbatch.db import session_factory
    from specbatch.jobs import intake, store
    from specbatch.worker.enqueue import enqueue_requests

    elsewhere = cluster.settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'elsewhere.db'}"})
    db.upgrade(elsewhere.database_url)
    queue = cluster.queue()
    with session_factory(elsewhere.database_url).begin() as s:      # a job no worker's database holds
        stray = store.create_job(s, target=str(cluster.models / "llama"), drafts=[str(cluster.models / "llama-partial")],
                                 params={}, requests=intake.parse_file(cluster.prompts(ROWS[:1]), {}, elsewhere),
                                 queue=queue)
        stray_ids = list(store.resumable_request_ids(s, stray.id))
    enqueue_requests(elsewhere, stray.id, stray_ids, queue)         # first in the queue
    right = cluster.worker("right")
    job_id, _ = cluster.submit(ROWS)
    summary = cluster.wait_finished(job_id)
    assert summary["status"] == "completed", summary
    assert "REFUSED" in right.output() and f"job {stray.id} is in another database" in right.output(), \
        right.output()[-3000:]
    assert _consumes(cluster, "right@", queue)
    # passed on again 5 s later: the message sent back carried its count (kwargs "passes"), through Redis
    wait_for(lambda: "(try 2 of 12)" in right.output(), 60, "the stray task's second pass")


def test_target_that_keeps_failing_makes_the_worker_unhealthy_not_the_queue(cluster) -> None:  # noqa: ANN001
    broken = cluster.worker("broken", imports=("tests.worker.broken_target_hook",))
    job_id, _ = cluster.submit(ROWS)
    queue = cluster.queue()
    wait_for(lambda: "worker unhealthy" in broken.output(), 120, "the worker to mark itself unhealthy")
    wait_for(lambda: not _consumes(cluster, "broken@", queue), 30, "the unhealthy worker to stop consuming")
    rows = cluster.rows(job_id)
    assert all(r["status"] == "pending" and r["attempts"] == 0 for r in rows), rows   # nothing failed
    assert broken.output().count("target failure on job") == cluster.settings.target_failure_limit
    cluster.worker("healthy")
    assert cluster.wait_finished(job_id)["status"] == "completed"


def test_fallback_draft_is_per_job_and_every_result_says_lossy(cluster, tmp_path) -> None:  # noqa: ANN001
    """Only a job submitted with --fallback-draft falls back; its results are flagged lossy in the
    database and in every export format."""
    import json

    from click.testing import CliRunner

    from specbatch.cli.main import cli
    from specbatch.config import get_settings

    broken = cluster.worker("broken", imports=("tests.worker.broken_target_hook",))
    prompts = cluster.prompts(ROWS[:2])
    get_settings.cache_clear()
    submitted = CliRunner().invoke(cli, ["submit", str(prompts), "--target", str(cluster.models / "llama"),
                                         "--draft", str(cluster.models / "llama-partial"),
                                         "--fallback-draft", "--json"])
    assert submitted.exit_code == 0, submitted.output
    job_id = json.loads(submitted.stdout[submitted.stdout.index("{"):])["job_id"]
    assert cluster.wait_finished(job_id)["status"] == "completed"
    assert "LOSSY" in broken.output()
    from specbatch.db import session_factory
    from specbatch.db.models import Result

    with session_factory(cluster.settings.database_url).begin() as s:
        results = s.query(Result).filter_by(job_id=job_id).all()
        assert len(results) == 2 and all(r.lossy for r in results)
        assert {r.target for r in results} == {str(cluster.models / "llama-partial")}
    import pyarrow.parquet as pq

    for fmt in ("jsonl", "csv", "parquet"):
        out = tmp_path / f"out.{fmt}"
        assert CliRunner().invoke(cli, ["export", job_id, "-o", str(out), "--format", fmt]).exit_code == 0
        if fmt == "jsonl":
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            assert [x["response"]["body"]["specbatch"]["lossy"] for x in lines] == [True, True]
        elif fmt == "csv":
            import csv

            assert [r["lossy"] for r in csv.DictReader(out.open())] == ["True", "True"]
        else:
            assert pq.read_table(out).column("lossy").to_pylist() == [True, True]
