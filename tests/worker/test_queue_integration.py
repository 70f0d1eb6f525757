"""The queue with the real thing: redis-server, `specbatch worker` subprocesses, SQLite, tiny models."""

from __future__ import annotations

import signal
import time

import pytest
import requests

from tests.worker.services import get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _rows(n: int, max_tokens: int = 6, prefix: str = "q") -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "prompt": f"The quick brown fox {i}", "max_tokens": max_tokens}
            for i in range(n)]


# Every decode step of the pool child 50 ms longer, so a test sees a job's rows running and acts on
# them before they end: the tiny model ends "The quick brown fox {i}" at 37-124 tokens whatever
# max_tokens asks, so a 2-row chunk was "running" for 0.1-0.3 s (2-3 polls 0.1 s apart on a quiet
# machine; a poller descheduled that long on 2 loaded cores missed it and waited out its 90 s, or
# killed a worker after its chunk had ended); with these steps, about 6.5 s.
SLOW_STEPS = "tests.worker.slow_step_hook"


def _one_result_each(rows: list[dict]) -> None:
    assert all(r["results"] == 1 for r in rows), rows


def test_end_to_end_duplicate_message_and_flower(cluster) -> None:  # noqa: ANN001
    """A job end to end; the same task message published twice makes one row; Flower sees it all."""
    from celery import Celery

    from specbatch.worker.app import TASK_NAME
    from specbatch.worker.monitor import queue_has_consumer

    flower, port = cluster.flower(password="s3cret")
    cluster.worker("w1")
    assert queue_has_consumer(cluster.settings, cluster.queue()) is True
    assert queue_has_consumer(cluster.settings, "specbatch.nobody") is False

    job_id, ids = cluster.create_job(_rows(4))
    producer = Celery("t", broker=cluster.redis.url, set_as_current=False)
    producer.conf.task_serializer = "json"
    for chunk in (ids[:2], ids[2:]):
        for _ in range(2):  # the same message (same task id) twice
            producer.send_task(TASK_NAME, args=[job_id, chunk], queue=cluster.queue(),
                               task_id=f"{job_id}-{chunk[0]}")
    summary = cluster.wait_finished(job_id)
    assert summary["status"] == "completed"
    rows = cluster.rows(job_id)
    _one_result_each(rows)
    assert [r["attempts"] for r in rows] == [1, 1, 1, 1]

    # Flower, with basic auth, lists the worker and the job's tasks as SUCCESS
    base = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: get_json(base + "/healthcheck", None) is not None, 60, "flower to start")
    assert requests.get(base + "/api/workers", timeout=5).status_code == 401
    auth = ("admin", "s3cret")
    workers = wait_for(lambda: _workers(base, auth), 60, "flower to list the worker")
    assert any(name.startswith("w1@") for name in workers), workers

    def job_tasks() -> dict | None:
        tasks = get_json(base + "/api/tasks", auth) or {}
        mine = {k: v for k, v in tasks.items() if job_id in str(v.get("args"))}
        return mine if len(mine) >= 2 and all(v["state"] == "SUCCESS" for v in mine.values()) else None
    tasks = wait_for(job_tasks, 60, "flower to show the job's tasks SUCCESS")
    assert all(t["name"] == TASK_NAME for t in tasks.values())


def _workers(base: str, auth) -> dict | None:  # noqa: ANN001
    data = get_json(base + "/api/workers?refresh=1", auth)
    return data or None


def _wait_running(cluster, job_id: str, n: int = 1) -> list[dict]:  # noqa: ANN001
    try:
        return wait_for(lambda: [r for r in cluster.rows(job_id) if r["status"] == "running"] or None,
                        90, "a request to be running", interval=0.1)
    except AssertionError as e:   # say whether the job stalled or finished between two polls
        rows = [(r["status"], r["results"], r["attempts"]) for r in cluster.rows(job_id)]
        raise AssertionError(f"{e}; rows (status, results, attempts): {rows}") from e


def test_sigkill_pool_child_then_whole_worker_then_second_worker(cluster) -> None:  # noqa: ANN001
    """SIGKILL of the pool child (the parent resends), then of the whole worker: a second worker
    finishes the job with exactly one result per request.

    At the default --batch-size auto the worker also claims requests ahead of its batch; the
    kills charge attempts only to the rows it was decoding. Two kills may both hit one row (a
    suspect from the first kill runs alone, and may be the row decoding at the second), so three
    attempts let every row finish; fewer would fail it, as the contract says."""
    cluster.env["SPECBATCH_MAX_ATTEMPTS"] = "3"
    w1 = cluster.worker("w1", imports=(SLOW_STEPS,))
    # long enough that rows still decode after the first result is in (at 48 tokens the five
    # left could all finish between two polls: seen once in CI, under load; at 300 the tiny model's
    # end of text still ended a chunk in 0.1-0.3 s: slow steps, as below)
    job_id, ids = cluster.submit(_rows(6, max_tokens=300))
    _wait_running(cluster, job_id)
    children = w1.pool_children()
    assert children, w1.output()[-2000:]
    for pid in children:
        import os

        os.kill(pid, signal.SIGKILL)
    # the parent starts a new child, which loads its models and carries on
    wait_for(lambda: sum(r["results"] for r in cluster.rows(job_id)) >= 1, 120, "progress after the child died")
    _wait_running(cluster, job_id)
    import os

    os.killpg(w1.pid, signal.SIGKILL)
    w1.wait(10)
    assert cluster.summary(job_id)["status"] == "running"
    cluster.worker("w2")
    summary = cluster.wait_finished(job_id, timeout=180)
    assert summary["status"] == "completed", summary
    _one_result_each(cluster.rows(job_id))


def test_sigterm_mid_prompt_finishes_it_nothing_redelivered(cluster) -> None:  # noqa: ANN001
    w1 = cluster.worker("w1", imports=(SLOW_STEPS,))
    # one chunk; long enough to be seen running (a 2-row batch of tiny models decodes in ms a step)
    job_id, ids = cluster.submit(_rows(2, max_tokens=300))
    running = _wait_running(cluster, job_id)
    w1.signal(signal.SIGTERM)
    assert w1.wait(120) == 0, w1.output()[-3000:]
    rows = cluster.rows(job_id)
    assert rows[0]["id"] == running[0]["id"]
    assert rows[0]["status"] == "completed" and rows[0]["results"] == 1, rows
    assert all(r["attempts"] <= 1 for r in rows), rows
    client = cluster.redis.client()
    assert client.llen(cluster.queue()) == 0 and client.hlen("unacked") == 0 \
        or cluster.summary(job_id)["status"] == "completed"
    if cluster.summary(job_id)["status"] != "completed":  # the rest went back to the queue
        cluster.worker("w2")
        cluster.wait_finished(job_id)
    rows = cluster.rows(job_id)
    _one_result_each(rows)
    assert [r["attempts"] for r in rows] == [1, 1], rows


def test_redis_restarted_mid_job_completes_with_resume(cluster) -> None:  # noqa: ANN001
    from click.testing import CliRunner

    from specbatch.cli.main import cli

    w1 = cluster.worker("w1", imports=(SLOW_STEPS,))
    job_id, ids = cluster.submit(_rows(6, max_tokens=300))   # long enough to be seen running
    _wait_running(cluster, job_id)
    cluster.redis.restart(down_seconds=1.0)  # no persistence: every queued message is gone
    time.sleep(cluster.settings.lease_seconds + 1)
    result = CliRunner().invoke(cli, ["resume", job_id, "--json"])
    assert result.exit_code == 0, result.output
    summary = cluster.wait_finished(job_id, timeout=180)
    assert summary["status"] == "completed", summary
    _one_result_each(cluster.rows(job_id))
    # the loss is logged in a line or two, without Celery's warning about its own next version
    log = w1.output()
    assert "Connection to broker lost" in log and "Celery 6.0" not in log and "Traceback" not in log, log


def test_two_pairs_are_routed_to_their_own_workers(cluster) -> None:  # noqa: ANN001
    cluster.worker("llama", target="llama", draft="llama-partial")
    cluster.worker("gpt2", target="gpt2", draft="gpt2-partial")
    assert cluster.queue("llama", "llama-partial") != cluster.queue("gpt2", "gpt2-partial")
    job_l, _ = cluster.submit(_rows(3), target="llama", draft="llama-partial")
    job_g, _ = cluster.submit(_rows(3), target="gpt2", draft="gpt2-partial")
    cluster.wait_finished(job_l)
    cluster.wait_finished(job_g)
    assert all(r["worker"].startswith("llama@") for r in cluster.rows(job_l)), cluster.rows(job_l)
    assert all(r["worker"].startswith("gpt2@") for r in cluster.rows(job_g)), cluster.rows(job_g)


def test_poison_request_bounded_attempts_then_failed(cluster) -> None:  # noqa: ANN001
    cluster.worker("w1", imports=("tests.worker.poison_hook",))
    rows = _rows(3)
    rows.insert(1, {"custom_id": "poison", "prompt": "POISON pill", "max_tokens": 4})
    job_id, _ = cluster.submit(rows)
    summary = cluster.wait_finished(job_id, timeout=240)
    assert summary["status"] == "completed_with_errors", summary
    by_id = {r["custom_id"]: r for r in cluster.rows(job_id)}
    poison = by_id.pop("poison")
    assert poison["status"] == "failed" and poison["results"] == 0, poison
    assert poison["attempts"] == cluster.settings.max_attempts and "the process decoding it died each time (last: w1@" in poison["error"]
    assert all(r["status"] == "completed" and r["results"] == 1 for r in by_id.values()), by_id


def test_worker_with_a_bad_model_path_exits_nonzero(cluster, tmp_path) -> None:  # noqa: ANN001
    import subprocess

    from tests.worker.conftest import CLI

    out = subprocess.run([*CLI, "worker", "--target", str(tmp_path / "no-such-model"), "--draft",
                          str(cluster.models / "llama-partial")], env=cluster.env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode != 0
    assert "cannot load models" in out.stderr and "no-such-model" in out.stderr, out.stderr[-3000:]
