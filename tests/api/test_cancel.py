"""Cancelling a batch, in process through the official `openai` client: one that has ended is
refused as OpenAI refuses it (409, "Cannot cancel a batch with status 'completed'."), never a 5xx."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
from sqlalchemy import update

from specbatch import db
from specbatch.api.app import create_app
from specbatch.config import Settings
from specbatch.db.models import ApiBatch
from specbatch.jobs import batches, store
from tests.api.test_reads import _seed
from tests.jobs.test_store import output


def _ended(url: str, settings: Settings) -> dict[str, str]:
    """{status: batch id} of batches that ended each way, and one still in progress."""
    factory, reader = db.session_factory(url), db.session_factory(url, readonly=True)
    _, running, failed = _seed(url)
    completed, expired = _seed(url)[1], _seed(url)[1]
    with factory.begin() as s:
        job_id = str(batches.get_batch(s, completed).job_id)
        (rid,) = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, [rid], "w", 60, 4)
        store.record_result(s, rid, output(), "w")
        store.refresh_job(s, job_id)
        s.execute(update(ApiBatch).where(ApiBatch.id == expired).values(
            expires_at=batches.get_batch(s, expired).created_at - timedelta(seconds=1)))
        batches.expire(s, expired)
    for batch_id in (completed, expired):
        assert batches.finalize(settings, factory, reader, batch_id)
    return {"completed": completed, "failed": failed, "expired": expired, "in_progress": running}


def test_a_batch_that_has_ended_cannot_be_cancelled_as_on_openai(tmp_path: Path) -> None:
    """OpenAI answers 409 with "Cannot cancel a batch with status 'completed'." (invalid_request_error;
    the client's ConflictError: BerriAI/litellm's tests/batches_tests/test_openai_batches_and_files.py
    catches it from the live API); ours answered 200 with the batch unchanged (tidy53)."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    settings = Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                  "SPECBATCH_BROKER_URL": "memory://"})
    app = create_app(settings)
    ids = _ended(url, settings)

    async def cancel(batch_id: str) -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http, max_retries=0)
            try:
                return await client.batches.cancel(batch_id)
            except openai.APIStatusError as e:
                return e

    for status in ("completed", "failed", "expired"):
        e = anyio.run(cancel, ids[status])
        assert isinstance(e, openai.ConflictError), (status, e)
        assert e.body == {"message": f"Cannot cancel a batch with status '{status}'.",
                          "type": "invalid_request_error", "param": None, "code": None}, e.body
    assert anyio.run(cancel, ids["in_progress"]).status in ("cancelling", "cancelled")
    assert anyio.run(cancel, ids["in_progress"]).status in ("cancelling", "cancelled")   # (again: still 200)
    db.forget_engines()


def test_the_official_client_does_not_retry_a_refused_cancel(tmp_path: Path) -> None:
    """openai-python retries a 409 ("lock timeouts") twice, with backoff, unless the answer says
    x-should-retry: false: a cancel of an ended batch, or the deletion of a live batch's input, was
    sent three times and raised after seconds of waiting for an answer that cannot change (review53)."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    settings = Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                  "SPECBATCH_BROKER_URL": "memory://"})
    app = create_app(settings)
    ids = _ended(url, settings)
    with db.session_factory(url).begin() as s:
        live_input = batches.get_batch(s, ids["in_progress"]).input_file_id
    sent: list[str] = []

    async def refused(call: Any) -> Any:
        async def on_request(request: httpx.Request) -> None:
            sent.append(request.url.path)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     event_hooks={"request": [on_request]}) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)   # retries as shipped
            try:
                return await call(client)
            except openai.APIStatusError as e:
                return e

    e = anyio.run(refused, lambda c: c.batches.cancel(ids["completed"]))
    assert isinstance(e, openai.ConflictError) and e.response.headers["x-should-retry"] == "false", e
    e = anyio.run(refused, lambda c: c.files.delete(live_input))
    assert isinstance(e, openai.ConflictError) and e.body["code"] == "file_in_use", e
    assert sent == [f"/v1/batches/{ids['completed']}/cancel", f"/v1/files/{live_input}"], sent
    db.forget_engines()
