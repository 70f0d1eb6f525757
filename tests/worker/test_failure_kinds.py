"""Who failed a request is recorded, so the export can say 400 (the request) or 500 (the worker)."""

from __future__ import annotations

import sqlalchemy.exc as sa_exc
from sqlalchemy import select

from specbatch.db.models import Request
from specbatch.engine.types import GenerationOutput, GenerationStats
from specbatch.errors import RequestError
from specbatch.jobs import store
from specbatch.worker.chunk import process_chunk
from tests.worker.test_chunk_unit import _job


class MixedEngine:
    """Request 0 is too long (its own fault); the others generate."""

    batch_size = 1

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        if on_start is not None:
            on_start(list(range(len(requests))))
        for i, _ in enumerate(requests):
            if i == 0:
                yield i, RequestError("prompt + max_new_tokens exceeds the context", field="max_new_tokens")
            else:
                yield i, GenerationOutput("ok", [1], "length", GenerationStats(new_tokens=1, verify_steps=1))


def _kinds(settings, job_id):
    from specbatch.db import session_factory

    with session_factory(settings.database_url).begin() as s:
        return s.execute(select(Request.custom_id, Request.status, Request.error_type, Request.error_param)
                         .where(Request.job_id == job_id).order_by(Request.id)).all()


def test_request_fault_is_invalid_request_and_storage_fault_is_server_error(tmp_path, monkeypatch):
    settings, job_id, ids = _job(tmp_path, 3)
    real = store.record_result

    def refuse_last(s, request_id, output, worker, **kw):
        if request_id == ids[2]:
            raise sa_exc.DataError("INSERT ...", {}, ValueError("text fields cannot contain NUL"))
        return real(s, request_id, output, worker, **kw)

    monkeypatch.setattr(store, "record_result", refuse_last)
    # one id per call: the fake engine fails the first request of each call
    for rid in ids:
        process_chunk(settings, MixedEngine() if rid == ids[0] else _Ok(), [rid], "w1")
    got = [(c, st.value, t, p) for c, st, t, p in _kinds(settings, job_id)]
    assert got == [("r0", "failed", store.INVALID_REQUEST, "max_new_tokens"),
                   ("r1", "completed", None, None),
                   ("r2", "failed", store.SERVER_ERROR, None)]


def test_out_of_attempts_is_server_error_and_retry_clears_it(tmp_path):
    from specbatch.db import session_factory

    settings, job_id, ids = _job(tmp_path, 1)
    with session_factory(settings.database_url).begin() as s:
        for _ in range(2):                      # started twice, its worker died each time
            store.claim_requests(s, ids, "w", 0, 2)
            store.start_requests(s, ids, "w")
        assert store.claim_requests(s, ids, "w", 0, 2) == []
    assert [(st.value, t) for _, st, t, _ in _kinds(settings, job_id)] == [("failed", store.SERVER_ERROR)]
    with session_factory(settings.database_url).begin() as s:
        store.retry_failed(s, job_id)
    assert [(st.value, t) for _, st, t, _ in _kinds(settings, job_id)] == [("pending", None)]


class _Ok:
    batch_size = 1

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        if on_start is not None:
            on_start(list(range(len(requests))))
        for i, _ in enumerate(requests):
            yield i, GenerationOutput("ok", [1], "length", GenerationStats(new_tokens=1, verify_steps=1))
