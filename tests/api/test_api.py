"""The HTTP API with the official `openai` client against a real `specbatch serve` (real Redis, SQLite
and PostgreSQL): files, batch creation through the CLI's intake, pagination, auth, OpenAI-shaped
errors, limits, concurrency. No worker here: jobs stay queued (tests/api/test_e2e.py runs them)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.engine.known_models import missing_weights
from tests.api.conftest import KEYS, Api, chat_line, start_api
from tests.worker.conftest import FAST
from tests.worker.services import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request: pytest.FixtureRequest, api_redis, tiny_models: Path,  # noqa: ANN001
        tmp_path_factory: pytest.TempPathFactory) -> Api:
    server = start_api(request, request.param, api_redis, tiny_models, tmp_path_factory.mktemp("api"))
    yield server
    server.close()


def _db(api: Api) -> Any:
    from specbatch.db import session_factory

    return session_factory(api.db_url)


def _jobs(api: Api) -> dict[str, Any]:
    from sqlalchemy import select

    from specbatch.db.models import Job

    with _db(api).begin() as s:
        return {j.id: (j.total, dict(j.meta), dict(j.params), j.queue, j.target, list(j.drafts))
                for j in s.scalars(select(Job))}


def _error(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_upload_create_and_read_back(api: Api) -> None:
    c = api.client()
    rows = [chat_line(i) for i in range(5)]
    f = api.upload(rows)
    assert (f.object, f.purpose, f.status, f.filename) == ("file", "batch", "processed", "in.jsonl")
    assert f.bytes == len("".join(json.dumps(r) + "\n" for r in rows).encode())
    assert c.files.retrieve(f.id).model_dump() == f.model_dump()
    assert c.files.content(f.id).content == "".join(json.dumps(r) + "\n" for r in rows).encode()
    # durably under the files dir, never the temp dir
    assert (Path(api.env["SPECBATCH_FILES_DIR"]) / f.id).read_bytes() == c.files.content(f.id).content

    target, draft = str(api.models / "llama"), str(api.models / "llama-partial")
    from specbatch.worker.queues import queue_name
    queue = queue_name(target, [draft])
    waiting = api.redis.client().llen(queue)       # Redis is shared by the module's servers
    before = _jobs(api)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"specbatch_target": target, "specbatch_draft": draft,
                                   "specbatch_temperature": "0.5", "specbatch_seed": "7",
                                   "specbatch_stop": '["\\n\\n", "END"]', "team": "data"})
    assert (b.object, b.status, b.endpoint, b.input_file_id) == ("batch", "in_progress", "/v1/chat/completions", f.id)
    assert b.request_counts.model_dump() == {"total": 5, "completed": 0, "failed": 0}
    assert b.in_progress_at and b.created_at <= b.in_progress_at and b.expires_at == b.created_at + 24 * 3600
    assert b.completed_at is None and b.output_file_id is None and b.model == target
    assert b.metadata["team"] == "data"
    # no worker runs here: the server's log says why the batch will not move (qa57: it said nothing)
    wait_for(lambda: f"batch {b.id} waits: no live worker consumes queue {queue}" in api.procs[0].output(),
             30, "the server's line on the batch's queue")

    # the job went through the CLI's intake and submit path: rows, defaults, pair, queue, tasks
    new = {k: v for k, v in _jobs(api).items() if k not in before}
    assert len(new) == 1
    total, meta, params, job_queue, job_target, drafts = next(iter(new.values()))
    assert total == 5 and meta["batch_id"] == b.id and meta["team"] == "data"
    assert params == {"temperature": 0.5, "seed": 7, "stop": ["\n\n", "END"]}
    assert (job_target, drafts) == (target, [draft])
    assert job_queue == queue
    assert api.redis.client().llen(queue) - waiting == math.ceil(5 / int(FAST["SPECBATCH_CHUNK_SIZE"]))

    assert c.batches.retrieve(b.id).model_dump() == b.model_dump()
    status, stats = api.get(f"/v1/batches/{b.id}/stats")
    assert status == 200 and stats["request_counts"]["pending"] == 5 and stats["stats"]["results"] == 0

    # the input of a batch with requests to run stays (409); once it has ended, deleting removes it for good
    with pytest.raises(openai.ConflictError):
        c.files.delete(f.id)
    c.batches.cancel(b.id)
    assert c.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    assert not (Path(api.env["SPECBATCH_FILES_DIR"]) / f.id).exists()


def test_list_batches_and_files_paginate(api: Api) -> None:
    c = api.client()
    f = api.upload([chat_line(0)])
    made = [c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="24h").id for _ in range(5)]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more is True
    # the client follows the cursor itself: newest first, each batch once
    seen = [b.id for b in c.batches.list(limit=2)]
    assert seen[:5] == made[::-1] and len(seen) == len(set(seen))
    status, raw = api.get("/v1/batches?limit=2&after=" + made[3])
    assert status == 200 and raw["object"] == "list"
    assert [b["id"] for b in raw["data"]] == [made[2], made[1]]
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (made[2], made[1], True)
    g = api.upload([chat_line(1)], name="second.jsonl")
    files = c.files.list(limit=1, purpose="batch")
    assert [x.id for x in files.data] == [g.id] and files.has_more is True
    assert [x.id for x in c.files.list(order="asc")][-2:] == [f.id, g.id]


def test_keys_are_required_and_checked(api: Api) -> None:
    for key, code in ((None, "missing_api_key"), ("sk-wrong", "invalid_api_key")):
        status, body = api.request("GET", "/v1/batches", key=key)
        assert status == 401 and _error(body)["code"] == code
    with pytest.raises(openai.AuthenticationError) as e:
        api.client("sk-wrong").batches.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        api.client("sk-wrong").files.create(file=("x.jsonl", b'{"prompt": "hi"}\n'), purpose="batch")
    assert api.request("GET", "/metrics", key=None)[0] == 401
    assert api.client(KEYS[1]).batches.list(limit=1).object == "list"
    assert api.get("/healthz", key=None) == (200, {"status": "ok", "database": "ok", "broker": "ok"})


def test_unknown_ids_are_404_in_openai_shape(api: Api) -> None:
    c = api.client()
    for call in (lambda: c.batches.retrieve("batch_nope"), lambda: c.batches.cancel("batch_nope"),
                 lambda: c.files.retrieve("file-0123456789abcdef01234567"),
                 lambda: c.files.content("file-../../etc/passwd"), lambda: c.files.delete("file-x")):
        with pytest.raises(openai.NotFoundError):
            call()
    status, body = api.request("GET", "/v1/batches/batch_nope")
    assert status == 404 and _error(body)["message"] == "No such Batch object: batch_nope"
    with pytest.raises(openai.NotFoundError) as missing:
        c.batches.create(input_file_id="file-0123456789abcdef01234567", endpoint="/v1/chat/completions",
                         completion_window="24h")
    # the field of the request that names the missing file, not the URL's `id`
    assert missing.value.body["param"] == "input_file_id", missing.value.body


def test_invalid_file_gives_a_failed_batch_with_line_errors(api: Api) -> None:
    c = api.client()
    text = (json.dumps(chat_line(1)) + "\n" + "not json\n" + json.dumps({"custom_id": "x", "prompt": 3}) + "\n"
            + json.dumps(chat_line(1)) + "\n")
    f = api.upload(text, name="bad.jsonl")
    before = _jobs(api)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.failed_at and b.request_counts.total == 0
    errors = [(e.code, e.line, e.param) for e in b.errors.data]
    assert errors == [("invalid_json_line", 2, None), ("invalid_value", 3, "prompt"),
                      ("duplicate_custom_id", 4, "custom_id")], b.errors
    assert all(e.message for e in b.errors.data)
    assert _jobs(api) == before                               # a half-valid file writes nothing
    assert c.batches.retrieve(b.id).status == "failed"
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch with status 'failed'"):
        c.batches.cancel(b.id)      # (OpenAI's answer: tests/api/test_cancel.py)


def test_lines_of_another_endpoint_fail_the_batch_as_url_mismatch(api: Api) -> None:
    """OpenAI runs one endpoint per batch: a completions line (OpenAI's or a native prompt line) in a
    chat batch would come back as a text_completion that ChatCompletion cannot read."""
    c = api.client()
    completion = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny", "prompt": "Once", "max_tokens": 4}}
    f = api.upload([chat_line(0), completion, {"custom_id": "n", "prompt": "Once"}, chat_line(3)])
    before = _jobs(api)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.request_counts.total == 0
    assert [(e.code, e.line, e.param) for e in b.errors.data] == [("url_mismatch", 2, "url"), ("url_mismatch", 3, "url")]
    assert "/v1/completions request in a batch whose endpoint is /v1/chat/completions" in b.errors.data[0].message
    assert _jobs(api) == before
    ok = c.batches.create(input_file_id=api.upload([completion]).id, endpoint="/v1/completions",
                          completion_window="24h")
    assert ok.status != "failed", ok.errors


def test_bad_requests_are_400_naming_the_parameter(api: Api) -> None:
    c = api.client()
    f = api.upload([chat_line(0)])
    cases = [({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
             ({"metadata": {"specbatch_temperature": "hot"}}, "metadata.specbatch_temperature"),
             ({"metadata": {"specbatch_max_tokens": "0"}}, "metadata.specbatch_max_tokens"),
             ({"metadata": {"specbatch_max_tokens": "abc"}}, "metadata.specbatch_max_tokens"),
             ({"metadata": {"specbatch_colour": "red"}}, "metadata.specbatch_colour"),
             ({"metadata": {"specbatch_draft": " , "}}, "metadata.specbatch_draft"),
             ({"output_expires_after": {"anchor": "created_at", "seconds": -5}}, "output_expires_after.seconds"),
             ({"output_expires_after": {"anchor": "last_active_at", "seconds": 3600}}, "output_expires_after.anchor"),
             ({"extra_body": {"completion_windw": "24h"}}, "completion_windw")]
    if missing_weights("qwen2.5-coder-1.5b"):    # a known model whose weights are not installed here
        cases.append(({"metadata": {"specbatch_target": "qwen2.5-coder-1.5b"}}, "metadata.specbatch_target"))
    for change, param in cases:
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**args)
        assert e.value.body["param"] == param, (change, e.value.body)
        # the openai client shows only the message ("Error code: 400 - must be an integer, got 'abc'")
        assert param in e.value.message, (change, e.value.message)
    within = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 86_400})
    assert within.id.startswith("batch_")
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", b'{"prompt": "hi"}\n'), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    # the official client's nested expires_after reaches the form's check (kept until deleted anyway)
    assert c.files.create(file=("x.jsonl", b'{"prompt": "hi"}\n'), purpose="batch",
                          expires_after={"anchor": "created_at", "seconds": 3600}).status == "processed"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", b'{"prompt": "hi"}\n'), purpose="batch",
                       expires_after={"anchor": "created_at", "seconds": 60})
    assert e.value.body["param"] == "expires_after"


def test_a_binary_upload_is_refused_naming_its_line_and_leaves_nothing(api: Api) -> None:
    """A PNG, a UTF-16 file and a file with a NUL byte were stored as "processed" batch input."""
    c = api.client()
    files_dir = Path(api.env["SPECBATCH_FILES_DIR"])
    before, n_files = {p.name for p in files_dir.iterdir()}, len(list(c.files.list()))
    good = (json.dumps(chat_line(0)) + "\n").encode()
    cases = [(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "line 1 is not UTF-8 text (byte 0x89)"),
             ((json.dumps(chat_line(1)) + "\n").encode("utf-16"), "line 1 is not UTF-8 text: it looks like UTF-16"),
             (good + b'{"custom_id": "a\0"}\n', "line 2 holds a NUL byte"),
             (good + b"\n" + good[:20] + "é".encode()[:1] + good[20:], "line 3 is not UTF-8 text (byte 0xc3)"),
             (good + "é".encode()[:1], "line 2 is not UTF-8 text (byte 0xc3)")]      # cut at the end
    for data, why in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("in.jsonl", data), purpose="batch")
        assert e.value.status_code == 400 and e.value.body["param"] == "file", e.value.body
        assert e.value.body["message"].startswith(why), (why, e.value.body)
        assert "UTF-8" in e.value.body["message"] and "JSON Lines" in e.value.body["message"]
    assert {p.name for p in files_dir.iterdir()} == before
    assert not list((files_dir / ".incoming").iterdir())
    assert len(list(c.files.list())) == n_files
    # UTF-8 text split anywhere by the transfer, and a BOM, are text
    text = "\ufeff" + "".join(json.dumps(chat_line(i, content="é" * 3000), ensure_ascii=False) + "\n"
                               for i in range(3))
    assert c.files.create(file=("ok.jsonl", text.encode()), purpose="batch").status == "processed"


def test_oversize_uploads_are_refused_and_leave_nothing(api: Api) -> None:
    c = api.client()
    files_dir = Path(api.env["SPECBATCH_FILES_DIR"])
    before = {p.name for p in files_dir.iterdir()}
    n_files = len(list(c.files.list()))
    line = json.dumps(chat_line(0, content="x" * 900)) + "\n"
    too_big = line * (int(api.env["SPECBATCH_MAX_UPLOAD_BYTES"]) // len(line) + 2)
    too_long = (json.dumps({"prompt": "a"}) + "\n") * (int(api.env["SPECBATCH_MAX_REQUESTS"]) + 1)
    for text, code in ((too_big, "file_too_large"), (too_long, "too_many_lines")):
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", text.encode()), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["code"] == code
    assert {p.name for p in files_dir.iterdir()} == before
    assert not list((files_dir / ".incoming").iterdir())
    assert len(list(c.files.list())) == n_files


def test_ten_concurrent_clients_each_get_one_job(api: Api) -> None:
    before = _jobs(api)
    results: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            f = api.upload([chat_line(j, content=f"client {i} line {j}") for j in range(i + 1)], name=f"c{i}.jsonl")
            b = api.client().batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"client": str(i)})
            results[i] = (f.id, b.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len({b for _, b in results.values()}) == 10
    new = {k: v for k, v in _jobs(api).items() if k not in before}
    by_client = {int(meta["client"]): (total, meta["batch_id"]) for total, meta, *_ in new.values()}
    assert len(new) == 10 and sorted(by_client) == list(range(10))
    for i, (total, batch_id) in by_client.items():
        assert total == i + 1 and batch_id == results[i][1]
        assert api.client().batches.retrieve(batch_id).request_counts.total == i + 1


def test_cancel_a_queued_batch_gives_an_error_file(api: Api) -> None:
    c = api.client()
    f = api.upload([chat_line(i) for i in range(3)])
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = wait_for(lambda: (x := c.batches.retrieve(b.id)).status == "cancelled" and x, 30,
                    "the batch to be cancelled")
    assert done.cancelling_at and done.cancelled_at and done.output_file_id is None
    assert done.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    lines = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"], x["error"]["code"]) for x in lines] == \
        [(f"req-{i}", None, "batch_cancelled") for i in range(3)]
    assert c.files.retrieve(done.error_file_id).purpose == "batch_output"


def test_serve_refuses_a_public_address_without_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'x.db'}")
    monkeypatch.delenv("SPECBATCH_API_KEYS", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "SPECBATCH_API_KEYS" in result.output
    assert not (tmp_path / "x.db").exists()


def test_broker_down_healthz_503_and_nothing_is_written(api_redis, tiny_models: Path,  # noqa: ANN001
                                                         tmp_path: Path) -> None:
    from tests.worker.services import free_port

    server = Api(tmp_path, api_redis, f"sqlite:///{tmp_path / 'down.db'}", tiny_models)
    server.env["SPECBATCH_BROKER_URL"] = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"   # nobody listens
    server.start(healthy=False)
    try:
        status, body = server.get("/healthz", key=None)
        assert status == 503 and body["status"] == "unavailable" and body["database"] == "ok"
        assert body["broker"] != "ok" and "s3cret" not in json.dumps(body)
        c = server.client()
        f = server.upload([chat_line(0)])                  # files need no broker
        with pytest.raises(openai.APIStatusError) as e:
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert e.value.status_code == 503 and e.value.body["code"] == "broker_unavailable"
        assert "s3cret" not in json.dumps(e.value.body)
        assert _jobs(server) == {} and list(c.batches.list()) == []
        metrics = server.request("GET", "/metrics")[1].decode()
        assert "specbatch_broker_up 0.0" in metrics
    finally:
        server.close()


def test_a_batch_past_its_window_expires_on_read(api: Api) -> None:
    from sqlalchemy import update

    from specbatch.db.models import ApiBatch

    c = api.client()
    b = c.batches.create(input_file_id=api.upload([chat_line(i) for i in range(2)]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    with _db(api).begin() as s:
        s.execute(update(ApiBatch).where(ApiBatch.id == b.id).values(expires_at=ApiBatch.created_at))
    assert [x.id for x in c.batches.list(limit=1).data] == [b.id]     # listing expires it
    with _db(api).begin() as s:
        assert s.get(ApiBatch, b.id).expired_at is not None
    done = wait_for(lambda: (x := c.batches.retrieve(b.id)).status == "expired" and x, 30, "the batch to expire")
    assert done.expired_at and done.request_counts.failed == 2 and done.output_file_id is None
    codes = {json.loads(x)["error"]["code"] for x in c.files.content(done.error_file_id).text.splitlines()}
    assert codes == {"batch_expired"}


def test_model_map_metadata_routes_lines_by_body_model(api: Api) -> None:
    from sqlalchemy import select

    from specbatch.db.models import Request
    from specbatch.worker.queues import queue_name

    c = api.client()
    llama, gpt2 = (str(api.models / "llama"), [str(api.models / "llama-partial")]), \
        (str(api.models / "gpt2"), [str(api.models / "gpt2-partial")])
    rows = [{**chat_line(i), "body": {**chat_line(i)["body"], "model": "small" if i % 2 else "big"}} for i in range(4)]
    mapping = f"small={llama[0]},{llama[1][0]}; big={gpt2[0]},{gpt2[1][0]}"
    queues = [queue_name(t, d) for t, d in (llama, gpt2)]
    waiting = [api.redis.client().llen(q) for q in queues]
    b = c.batches.create(input_file_id=api.upload(rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"specbatch_model_map": mapping})
    assert b.status == "in_progress" and b.request_counts.total == 4
    job_id = api.get(f"/v1/batches/{b.id}/stats")[1]["job_id"]
    with _db(api).begin() as s:
        routed = {r.custom_id: r.target for r in s.scalars(select(Request).where(Request.job_id == job_id))}
    assert routed == {"req-0": gpt2[0], "req-1": llama[0], "req-2": gpt2[0], "req-3": llama[0]}
    assert [api.redis.client().llen(q) - w for q, w in zip(queues, waiting)] == [1, 1]   # chunks of 2
    # a body.model the map does not name is a line error
    rows[0]["body"]["model"] = "huge"
    bad = c.batches.create(input_file_id=api.upload(rows).id, endpoint="/v1/chat/completions",
                           completion_window="24h", metadata={"specbatch_model_map": mapping})
    assert bad.status == "failed" and [(e.line, e.param) for e in bad.errors.data] == [(1, "body.model")]


def test_every_answer_is_its_schema_model_and_the_openai_client_parses_it(api: Api) -> None:
    """/openapi.json names a model per route (api.models); the answers are built as dicts apart
    from them, so each is checked here: it validates, and the model dumps it back unchanged (no key
    the model lacks, none it adds). The official client parses the same answer."""
    from pydantic import BaseModel

    from specbatch.api import models

    c = api.client()

    def check(raw: Any, model: type[BaseModel]) -> Any:
        body = raw.http_response.json()
        assert model.model_validate(body).model_dump(mode="json", exclude_unset=True) == body, model
        return raw.parse()

    def stats(batch_id: str) -> None:
        status, body = api.get(f"/v1/batches/{batch_id}/stats")
        assert status == 200, body
        assert models.BatchStats.model_validate(body).model_dump(mode="json", exclude_unset=True) == body

    text = "".join(json.dumps(chat_line(i)) + "\n" for i in range(3)).encode()
    f = check(c.files.with_raw_response.create(file=("in.jsonl", text), purpose="batch"), models.FileObject)
    check(c.files.with_raw_response.retrieve(f.id), models.FileObject)
    b = check(c.batches.with_raw_response.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h", metadata={"team": "a"}), models.Batch)
    stats(b.id)
    assert check(c.batches.with_raw_response.cancel(b.id), models.Batch).status in ("cancelling", "cancelled")
    wait_for(lambda: c.batches.retrieve(b.id).status == "cancelled", 30, "the batch to be cancelled")
    done = check(c.batches.with_raw_response.retrieve(b.id), models.Batch)
    assert done.usage is not None and done.error_file_id and done.metadata == {"team": "a"}
    check(c.files.with_raw_response.retrieve(done.error_file_id), models.FileObject)

    bad = api.upload("not json\n", name="bad.jsonl")          # a failed batch: errors.data, no job
    failed = check(c.batches.with_raw_response.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h"), models.Batch)
    assert failed.status == "failed" and failed.errors.data[0].line == 1
    stats(failed.id)
    assert check(c.batches.with_raw_response.list(limit=2), models.BatchList).data
    assert check(c.files.with_raw_response.list(), models.FileList).data
    assert check(c.files.with_raw_response.delete(bad.id), models.FileDeleted).deleted
