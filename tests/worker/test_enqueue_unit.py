"""enqueue_requests against a broker that is down: the error is the whole story."""

from __future__ import annotations

import logging
import socket

import pytest

from specbatch.config import Settings
from specbatch.errors import BrokerUnavailable
from specbatch.worker.enqueue import enqueue_requests


def test_a_broker_down_from_the_start_is_the_error_alone_not_a_log_line_too(caplog, tmp_path) -> None:  # noqa: ANN001
    """`specbatch resume JOB` with Redis down printed a log-formatted line ("2026-... WARNING
    specbatch.worker.enqueue: job J: 0 task(s) sent before the broker failed") above its one
    `Error:` line (qa51). Nothing was sent: the error says it all."""
    from specbatch import db

    with socket.socket() as s:                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"sqlite:///{tmp_path / 'q.db'}"      # (a task names its job's database: read first)
    db.upgrade(url)
    settings = Settings.from_env({"SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{port}/0", "SPECBATCH_DATABASE_URL": url})
    with caplog.at_level(logging.WARNING), pytest.raises(BrokerUnavailable) as e:
        enqueue_requests(settings, "job1", [1, 2, 3], "q.down")
    assert "the job job1 is saved: start the broker" in str(e.value)
    assert [r.getMessage() for r in caplog.records if r.name == "specbatch.worker.enqueue"] == []


def test_submit_job_reads_the_database_id_before_it_writes_the_job(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The API's submit (POST /v1/batches): the id its tasks name the database by was read at the
    first send, after the job and its batch were written, so a database lost there left both saved
    and unsent, and a client that posted again made a second (review53b)."""
    from sqlalchemy import func, select
    from sqlalchemy.exc import OperationalError

    from specbatch import db
    from specbatch.db.models import Job
    from specbatch.jobs import intake
    from specbatch.worker.submission import Pair, submit_job

    url = f"sqlite:///{tmp_path / 's.db'}"
    db.upgrade(url)
    settings = Settings.from_env({"SPECBATCH_DATABASE_URL": url})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')

    def lost(url: str) -> str:
        raise OperationalError("SELECT specbatch_database.id", {}, Exception("server closed the connection"))

    monkeypatch.setattr(db, "database_id", lost)
    try:
        with pytest.raises(OperationalError):
            submit_job(settings, db.session_factory(url), intake.read_file(prompts, {}, settings),
                       pair=Pair("org/tgt"), defaults={}, source=None)
        with db.session_factory(url).begin() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 0
    finally:
        db.forget_engines()
