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
