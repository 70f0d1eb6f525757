"""process_chunk with a fake engine on a real SQLite file (unit level: the engine is faked)."""

from __future__ import annotations

import json

import sqlalchemy.exc as sa_exc

from specbatch.config import Settings
from specbatch.engine.types import GenerationOutput, GenerationStats
from specbatch.jobs import intake, store
from specbatch.worker.chunk import process_chunk


class FakeEngine:
    batch_size = 1

    def generate_many(self, requests, batch_size=None):
        for i, _ in enumerate(requests):
            yield i, GenerationOutput("ok", [1, 2], "length", GenerationStats(new_tokens=2, verify_steps=1))


def _job(tmp_path, n):
    from specbatch.db import session_factory

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": "hi"}) + "\n" for i in range(n)))
    parsed = intake.parse_file(path, {}, settings)
    with session_factory(settings.database_url).begin() as s:
        job = store.create_job(s, target="t", drafts=["d"], ngram=False, params={}, requests=parsed, queue="q")
        return settings, job.id, list(store.resumable_request_ids(s, job.id))


def test_a_result_that_cannot_be_stored_fails_its_request_and_the_job_goes_on(tmp_path, monkeypatch):
    from specbatch.db import session_factory

    settings, job_id, ids = _job(tmp_path, 3)
    real = store.record_result

    def refuse_second(s, request_id, output, worker, **kw):
        if request_id == ids[1]:
            raise sa_exc.DataError("INSERT ...", {}, ValueError("text fields cannot contain NUL"))
        return real(s, request_id, output, worker, **kw)

    monkeypatch.setattr(store, "record_result", refuse_second)
    report = process_chunk(settings, FakeEngine(), ids, "w1")
    assert report.completed == [ids[0], ids[2]] and report.failed == [ids[1]]
    with session_factory(settings.database_url).begin() as s:
        summary = store.job_summary(s, job_id)
    assert summary["status"] == "completed_with_errors"
    assert summary["request_counts"]["failed"] == 1 and summary["request_counts"]["running"] == 0
