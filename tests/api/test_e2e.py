"""End to end: the official `openai` client -> `specbatch serve` -> Redis -> a real `specbatch worker`
on tiny models -> output and error files; cancelling a running batch; /metrics against the
database. One server and one worker for the module (SQLite)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.api.conftest import Api, chat_line, start_api
from tests.worker.services import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(request: pytest.FixtureRequest, api_redis, tiny_models: Path,  # noqa: ANN001
        tmp_path_factory: pytest.TempPathFactory) -> Api:
    server = start_api(request, "sqlite", api_redis, tiny_models, tmp_path_factory.mktemp("e2e"))
    try:
        server.worker()
        yield server
    finally:
        server.close()


def _pair(api: Api) -> dict[str, str]:
    return {"specbatch_target": str(api.models / "llama"), "specbatch_draft": str(api.models / "llama-partial")}


def _wait(api: Api, batch_id: str, statuses: tuple[str, ...], timeout: float = 180) -> Any:
    c = api.client()
    try:
        return wait_for(lambda: (b := c.batches.retrieve(batch_id)).status in statuses and b, timeout,
                        f"batch {batch_id} to reach {statuses}", interval=0.3)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{api.procs[-1].output()[-3000:]}") from None


def _results(api: Api, job_id: str) -> dict[str, str]:
    from specbatch.db import session_factory
    from specbatch.db.models import Request, Result

    with session_factory(api.db_url).begin() as s:
        return dict(s.execute(select(Request.custom_id, Result.text).join(Result, Result.request_id == Request.id)
                              .where(Request.job_id == job_id)).all())


def test_batch_runs_to_completion_with_output_and_error_files(api: Api) -> None:
    c = api.client()
    rows = [chat_line(0, 6), chat_line(1, 6, "Say hi"), chat_line(3, 6, "Count to five")]
    f = api.upload(rows)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata=_pair(api))
    done = _wait(api, b.id, ("completed",))
    assert done.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert f"batch {b.id} waits" not in api.procs[0].output()      # a worker consumes its queue
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.cancelled_at is None and done.errors is None

    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["req-0", "req-1", "req-3"]       # input order
    if done.error_file_id is not None:                   # no failed request: nothing in it
        assert c.files.content(done.error_file_id).text == ""
    stats = api.get(f"/v1/batches/{b.id}/stats")[1]
    texts = _results(api, stats["job_id"])
    for line in out:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == texts[line["custom_id"]]
        assert 1 <= body["usage"]["completion_tokens"] <= 6
    assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert stats["stats"]["tokens_generated"] == done.usage.output_tokens
    assert c.files.retrieve(done.output_file_id).bytes == len(c.files.content(done.output_file_id).content)


def test_n_samples_come_back_as_n_choices(api: Api) -> None:
    """A line with n = 3 through the API and a worker: one request (the batch counts lines), three
    choices that the official client's types parse, usage summed as OpenAI sums it."""
    from openai.types.chat import ChatCompletion

    c = api.client()
    line = chat_line(0, 5, "Say something")
    line["body"].update(n=3, temperature=1.0, seed=9)
    b = c.batches.create(input_file_id=api.upload([line, chat_line(1, 4)]).id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata=_pair(api))
    done = _wait(api, b.id, ("completed",))
    assert done.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    bodies = [ChatCompletion.model_validate(x["response"]["body"]) for x in out]
    assert [len(b.choices) for b in bodies] == [3, 1]
    sampled = bodies[0]
    assert [ch.index for ch in sampled.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in sampled.choices}) == 3          # seeded samples differ
    assert sampled.usage is not None and bodies[1].usage is not None
    assert sampled.usage.total_tokens == sampled.usage.prompt_tokens + sampled.usage.completion_tokens
    # the batch's usage: every choice's tokens, each line's prompt once
    assert done.usage.output_tokens == sum(b.usage.completion_tokens for b in bodies if b.usage)
    assert done.usage.input_tokens == sum(b.usage.prompt_tokens for b in bodies if b.usage)


def test_a_prompt_over_the_context_fails_the_batch_at_intake(api: Api) -> None:
    """The pair's context is checked when the batch is created (prompt + 600 tokens > 512): a failed
    batch naming the line, no job for a worker to fail later."""
    c = api.client()
    b = c.batches.create(input_file_id=api.upload([chat_line(0, 6), chat_line(1, 600)]).id,
                         endpoint="/v1/chat/completions", completion_window="24h", metadata=_pair(api))
    assert b.status == "failed" and b.errors is not None
    (e,) = b.errors.data
    # 600 tokens alone are over the context: the field the line gave is named (it was body.messages)
    assert (e.line, e.param) == (2, "body.max_tokens") and "exceeds the context of" in e.message, e
    assert "lower max_tokens" in e.message, e
    long = chat_line(2, 6, content="word " * 600)
    del long["body"]["max_tokens"]
    for lines, meta, param in (([chat_line(0, 6), long], {}, "body.messages"),
                               ([{**chat_line(0), "body": {k: v for k, v in chat_line(0)["body"].items()
                                                           if k != "max_tokens"}}],
                                {"specbatch_max_tokens": "100000000"}, "metadata.specbatch_max_tokens")):
        b = c.batches.create(input_file_id=api.upload(lines).id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={**_pair(api), **meta})
        assert b.status == "failed" and b.errors is not None
        assert [x.param for x in b.errors.data] == [param], b.errors
    from specbatch.db import session_factory
    from specbatch.db.models import ApiBatch

    with session_factory(api.db_url).begin() as s:
        assert s.get(ApiBatch, b.id).job_id is None          # nothing queued


def test_cancel_a_running_batch(api: Api) -> None:
    c = api.client()
    rows = [chat_line(i, 400, f"Tell a long story number {i}") for i in range(24)]
    b = c.batches.create(input_file_id=api.upload(rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata=_pair(api))
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 1, 180, "a first result", interval=0.2)
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = _wait(api, b.id, ("cancelled",))
    counts = done.request_counts
    assert 1 <= counts.completed < 24 and counts.completed + counts.failed == 24
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert len(out) == counts.completed and len(err) == counts.failed
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)


def test_metrics_match_the_database(api: Api) -> None:
    from specbatch.db import session_factory
    from specbatch.db.models import Job, Result

    status, text = api.request("GET", "/metrics")
    assert status == 200
    samples = {}
    for line in text.decode().splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    with session_factory(api.db_url).begin() as s:
        tokens, drafted, accepted, drafts = s.execute(select(
            func.sum(Result.completion_tokens), func.sum(Result.drafted_tokens), func.sum(Result.accepted_tokens),
            func.sum(Result.draft_steps))).one()
        jobs = s.scalar(select(func.count()).select_from(Job))
    assert tokens and drafted and accepted, "the jobs above drafted and accepted tokens"
    assert samples["specbatch_generation_tokens_total"] == tokens
    assert samples["specbatch_spec_decode_num_draft_tokens_total"] == drafted
    assert samples["specbatch_spec_decode_num_accepted_tokens_total"] == accepted
    assert samples["specbatch_spec_decode_num_drafts_total"] == drafts > 0
    per_pos = {k: v for k, v in samples.items() if k.startswith("specbatch_spec_decode_num_accepted_tokens_per_pos")}
    assert per_pos and sum(per_pos.values()) == accepted
    assert samples['specbatch_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == max(per_pos.values())
    assert sum(v for k, v in samples.items() if k.startswith("specbatch_jobs{")) == jobs
    assert samples["specbatch_broker_up"] == 1
