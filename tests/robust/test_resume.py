"""`resume` right after a worker was killed: it says which requests are still leased and when they
become claimable, queues them too, and names the job by its full id (#16 item 10)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from tests.worker.services import RedisServer

pytestmark = pytest.mark.integration


def test_resume_reports_leased_requests_and_the_full_job_id(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import update

    from specbatch.db import session_factory
    from specbatch.db.models import Request, RequestStatus, utcnow
    from specbatch.jobs import intake, store

    redis = RedisServer(tmp_path).start()
    try:
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
        monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
        monkeypatch.setenv("SPECBATCH_BROKER_URL", redis.url)
        monkeypatch.setenv("SPECBATCH_CHUNK_SIZE", "2")
        get_settings.cache_clear()
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(4)))
        parsed = intake.parse_file(prompts, {}, get_settings())
        with session_factory(url).begin() as s:
            job = store.create_job(s, target="t", drafts=["d"], params={}, requests=parsed,
                                   queue="specbatch.test.q")
            job_id = job.id
            ids = store.resumable_request_ids(s, job_id)
            # a worker was SIGKILLed holding two requests: their leases run 120 s more
            s.execute(update(Request).where(Request.id.in_(ids[:2])).values(
                status=RequestStatus.running, worker="gpu0@host:41", attempts=1,
                lease_expires_at=utcnow() + timedelta(seconds=120)))
        result = CliRunner().invoke(cli, ["resume", job_id[:6]])
        assert result.exit_code == 0, result.output
        assert f"job {job_id}: re-enqueued 4 requests in 2 tasks" in result.output
        assert "2 of them are still leased by gpu0@host:41: claimable from" in result.output
        assert "UTC (in 1" in result.output                      # ~120 s
        assert redis.client().llen("specbatch.test.q") == 2
    finally:
        redis.stop()


def test_resume_makes_the_rows_of_a_worker_killed_here_claimable_now(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user walk: after a worker of this machine was SIGKILLed, `resume` said its rows were
    "still leased by walk1@vm:10389 ... (in 262s)" though that PID was dead here. `cancel`'s check
    (worker.pids.gone_here) finds it; resume says so and the rows are claimable at once."""
    import socket
    import subprocess
    import sys

    from sqlalchemy import select, update

    from specbatch.db import session_factory
    from specbatch.db.models import Request, RequestStatus, utcnow
    from specbatch.jobs import intake, store

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = f"walk1@{socket.gethostname()}:{dead.pid}"
    redis = RedisServer(tmp_path).start()
    try:
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
        monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
        monkeypatch.setenv("SPECBATCH_BROKER_URL", redis.url)
        get_settings.cache_clear()
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(4)))
        parsed = intake.parse_file(prompts, {}, get_settings())
        with session_factory(url).begin() as s:
            job_id = store.create_job(s, target="t", drafts=["d"], params={}, requests=parsed,
                                      queue="specbatch.test.q").id
            ids = store.resumable_request_ids(s, job_id)
            lease = utcnow() + timedelta(seconds=260)
            s.execute(update(Request).where(Request.id.in_(ids[:2])).values(
                status=RequestStatus.running, worker=holder, attempts=1, lease_expires_at=lease))
            s.execute(update(Request).where(Request.id == ids[2]).values(   # a live worker elsewhere
                status=RequestStatus.running, worker="gpu0@elsewhere:41", attempts=1, lease_expires_at=lease))
        result = CliRunner().invoke(cli, ["resume", job_id])
        assert result.exit_code == 0, result.output
        assert f"2 of them were held by {holder}, which no longer runs on this machine: claimable now" \
            in result.output
        assert "1 of them is still leased by gpu0@elsewhere:41: claimable from" in result.output
        assert holder not in result.output.split("claimable now")[1]
        with session_factory(url).begin() as s:
            assert set(store.resumable_request_ids(s, job_id)) == {ids[0], ids[1], ids[3]}
            assert s.scalars(select(Request.attempts).where(Request.id == ids[0])).one() == 1   # still charged
    finally:
        redis.stop()
