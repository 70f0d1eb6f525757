"""``cancel`` leaves a job's queued tasks in the broker (checked here on a real redis-server): a
worker that receives one later drops it after one read of the job's status, without claiming its
requests or touching its models, and Flower shows it revoked."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.db import database_id, session_factory
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from specbatch.worker.enqueue import enqueue_requests
from specbatch.worker.stranded import _json, _request_ids
from tests.worker.services import RedisServer

pytestmark = pytest.mark.integration

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
QUEUE = "sb.cancelled-here"


def test_a_cancelled_jobs_queued_tasks_are_dropped_unread(redis_server: RedisServer, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from specbatch.worker import tasks

    monkeypatch.setenv("SPECBATCH_BROKER_URL", redis_server.url)
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'sb.db'}")
    monkeypatch.setenv("SPECBATCH_CHUNK_SIZE", "2")
    get_settings.cache_clear()
    settings = get_settings()
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(5)]
    with session_factory(settings.database_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d"], params={}, requests=reqs, queue=QUEUE).id
        ids = store.resumable_request_ids(s, job_id)
    assert enqueue_requests(settings, job_id, ids, QUEUE) == 3
    result = CliRunner().invoke(cli, ["cancel", job_id])
    assert result.exit_code == 0, result.output

    # the tasks stay queued: nothing in `cancel` reaches the broker
    here = database_id(settings.database_url)       # (the tasks name their database)
    queued = [_request_ids(_json(raw), here) for raw in redis_server.client().lrange(QUEUE, 0, -1)]
    assert sorted(queued, key=lambda t: t[1] if t else []) == [(job_id, ids[0:2]), (job_id, ids[2:4]),
                                                              (job_id, ids[4:])]

    def loads_work(*_: Any, **__: Any) -> Any:
        raise AssertionError("a cancelled job's task loaded work")
    monkeypatch.setattr(tasks.EngineTask, "engine", property(loads_work))
    monkeypatch.setattr(tasks, "refusal", loads_work)
    monkeypatch.setattr(tasks, "process_chunk", loads_work)
    events: list[str] = []
    monkeypatch.setattr(tasks.EngineTask, "send_event", lambda self, kind, **_: events.append(kind))
    for got in queued:
        assert got is not None
        outcome = tasks.process_chunk_task.apply(args=got)
        assert outcome.state == "IGNORED", (outcome.state, outcome.result)
    assert events == ["task-revoked"] * 3
    with session_factory(settings.database_url).begin() as s:
        assert store.request_counts(s, [job_id])[job_id]["cancelled"] == 5
        assert store.get_job(s, job_id).status.value == "cancelled"
