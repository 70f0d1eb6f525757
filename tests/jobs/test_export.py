"""Export on SQLite and PostgreSQL: OpenAI batch output lines (checked against a line model written
from OpenAI's batch guide and against the openai package's own body types), CSV, typed Parquet
read back by pyarrow, DuckDB, pandas and datasets."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select, text

from specbatch import db
from specbatch.config import Settings
from specbatch.db.models import RESULTS_VIEW, STATS_COLUMNS, Result
from specbatch.errors import RequestError
from specbatch.jobs import export, intake, store
from specbatch.jobs.openai_output import export_openai
from tests.jobs.test_store import output

# ---------------------------------------------------------------- the line, from OpenAI's batch guide


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LineResponse(_Strict):
    status_code: int
    request_id: str
    body: dict


class LineError(_Strict):
    code: str
    message: str


class BatchOutputLine(_Strict):
    """{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
    "error": {"code", "message"} | null}: nothing more, nothing less."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None


class ErrorDetail(_Strict):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class ErrorBody(_Strict):
    error: ErrorDetail


def check_line(line: dict) -> BatchOutputLine:
    """The line shape, and a body openai's own types accept for what the line says it is."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    parsed = BatchOutputLine.model_validate(line)
    assert (parsed.response is None) != (parsed.error is None)
    if parsed.response is not None and parsed.response.status_code == 200:
        body = parsed.response.body
        typ = ChatCompletion if body["object"] == "chat.completion" else Completion
        typ.model_validate(body)
        typ.model_validate_json(json.dumps(body))
    elif parsed.response is not None:
        ErrorBody.model_validate(parsed.response.body)
    return parsed


# ---------------------------------------------------------------- a job from a real OpenAI batch file

def _line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FILE = [
    _line("chat-ok", CHAT, {"model": "gpt-4o-mini", "messages": [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hi é"}]}],
        "max_completion_tokens": 8, "metadata": {"batch": "a", "topic": "greeting"}, "store": False}),
    _line("ids-ok", COMPLETIONS, {"model": "babbage-002", "prompt": [5, 6, 7], "max_tokens": 4}),
    _line("bad-request", CHAT, {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}],
                                "response_format": {"type": "json_object"}}),
    _line("worker-died", COMPLETIONS, {"model": "babbage-002", "prompt": "y"}),
    _line("never-ran", COMPLETIONS, {"model": "babbage-002", "prompt": "z"}),
]


@pytest.fixture
def job(db_url, tmp_path) -> tuple[str, str, list[int]]:
    """Five requests: completed chat, completed token-id completion, failed by its own fault (400),
    failed on the worker's side (500), pending."""
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(FILE) + "\n")
    parsed = intake.read_file(path, {}, Settings(database_url=db_url),
                              intake.parse_model_map(["gpt-4o-mini=tgt-chat,d-chat", "babbage-002=tgt"], allow_remote=True))
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={},
                                  requests=parsed.requests, queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids[:4], "w1", 60, 3)
        first = output(new_tokens=3, wins={"d-chat": 2})
        first.stats.draft_steps, first.stats.accepted_at_position = 2, [2, 1]
        first.stats.batch_size_seconds = {"1": 0.5}
        store.record_result(s, ids[0], first, "w1")
        store.record_result(s, ids[1], output(new_tokens=2), "w1")
        err = RequestError("prompt (9 tokens) + max_new_tokens exceeds the context", field="max_new_tokens")
        store.record_failure(s, ids[2], str(err), "w1", param=err.field)
        store.record_failure(s, ids[3], "attempted 3 times, the process decoding it died each time (last: w1)", "w1",
                             error_type=store.SERVER_ERROR)
        store.refresh_job(s, job_id)
    return db_url, job_id, ids


def _jsonl(url: str, job_id: str, **kw) -> list[dict]:
    buf = io.StringIO()
    with db.session_factory(url, readonly=True).begin() as s:
        export.write_openai(s, job_id, buf, **kw)
    return [json.loads(x) for x in buf.getvalue().splitlines()]


def test_every_line_has_the_batch_output_shape_in_input_order(job):
    url, job_id, _ = job
    lines = _jsonl(url, job_id)
    for line in lines:
        check_line(line)
    # the pending request is left out; the rest in file order
    assert [x["custom_id"] for x in lines] == ["chat-ok", "ids-ok", "bad-request", "worker-died"]
    assert len({x["id"] for x in lines}) == 4


def test_success_lines(job):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    url, job_id, _ = job
    chat, ids_line = _jsonl(url, job_id)[:2]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    c = ChatCompletion.model_validate(chat["response"]["body"])
    assert (c.object, c.model, c.choices[0].message.role, c.choices[0].message.content) == (
        "chat.completion", "tgt-chat", "assistant", "out")        # the model that generated it
    assert c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (5, 3, 8)
    sb = chat["response"]["body"]["specbatch"]
    assert (sb["target"], sb["drafts"], sb["acceptance_rate"], sb["pool_wins"]) == (
        "tgt-chat", ["d-chat"], 0.5, {"d-chat": 2})
    assert set(STATS_COLUMNS) <= set(sb)
    assert (sb["model"], sb["metadata"]) == ("gpt-4o-mini", {"batch": "a", "topic": "greeting"})
    t = Completion.model_validate(ids_line["response"]["body"])
    assert (t.object, t.model, t.choices[0].text, t.usage.completion_tokens) == ("text_completion", "tgt", "out", 2)


def test_a_cache_hit_names_the_generated_row_it_copies(job):
    """``cached`` / ``cached_from`` in the JSONL as in the specbatch_results view."""
    url, job_id, ids = job
    with db.session_factory(url).begin() as s:
        generated = s.scalars(select(Result).where(Result.request_id == ids[1])).one()
        store.claim_requests(s, ids[4:], "w2", 60, 3)
        store.record_cached_result(s, ids[4], generated, "w2")
        view = dict(s.execute(text(f"SELECT custom_id, cached_from FROM {RESULTS_VIEW}")).all())
    sb = {x["custom_id"]: x["response"]["body"]["specbatch"] for x in _jsonl(url, job_id)
          if x["response"] and x["response"]["status_code"] == 200}
    assert (sb["never-ran"]["cached"], sb["never-ran"]["cached_from"]) == (True, generated.id)
    assert (sb["ids-ok"]["cached"], sb["ids-ok"]["cached_from"]) == (False, None)
    assert {k: v["cached_from"] for k, v in sb.items()} == {k: view[k] for k in sb}


def test_failure_lines_are_400_for_the_request_and_500_for_the_worker(job):
    url, job_id, _ = job
    bad, died = _jsonl(url, job_id)[2:]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"] == {"error": {
        "message": "max_new_tokens: prompt (9 tokens) + max_new_tokens exceeds the context",
        "type": "invalid_request_error", "param": "max_new_tokens", "code": None}}
    assert died["error"] is None and died["response"]["status_code"] == 500
    assert died["response"]["body"]["error"]["type"] == "server_error"
    assert died["response"]["body"]["error"]["message"].startswith("attempted 3 times")


def test_cancelled_and_expired_requests(job):
    url, job_id, ids = job
    with db.session_factory(url, readonly=True).begin() as s:
        output_lines, errors = export_openai(s, job_id, expired=True)
    assert [x["custom_id"] for x in output_lines] == ["chat-ok", "ids-ok"]
    expired = errors[-1]
    assert check_line(expired) and expired["custom_id"] == "never-ran"
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"

    with db.session_factory(url).begin() as s:
        store.cancel_job(s, job_id)
    lines = _jsonl(url, job_id)
    cancelled = lines[-1]
    assert check_line(cancelled) and cancelled["custom_id"] == "never-ran"
    assert cancelled["response"] is None
    assert cancelled["error"] == {"code": "batch_cancelled",
                                  "message": "the batch was cancelled before this request was completed"}


def test_pending_rows_only_when_asked_for(job):
    url, job_id, _ = job
    lines = _jsonl(url, job_id, statuses=["pending"])
    assert [x["custom_id"] for x in lines] == ["never-ran"]
    assert check_line(lines[0]).error.code == "request_not_finished"
    assert [x["custom_id"] for x in _jsonl(url, job_id, statuses=["completed"])] == ["chat-ok", "ids-ok"]
    with pytest.raises(ValueError, match="unknown status"):
        _jsonl(url, job_id, statuses=["done"])


def test_output_and_error_files_in_one_call(job, tmp_path):
    url, job_id, _ = job
    out, err = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    with db.session_factory(url, readonly=True).begin() as s:
        assert export.write_openai(s, job_id, out, err) == (2, 2)
        with pytest.raises(export.ExportExists, match="exists; give --force"):
            export.write_openai(s, job_id, tmp_path / "new.jsonl", err)
        assert not (tmp_path / "new.jsonl").exists()               # nothing written when refused
        assert export.write_openai(s, job_id, out, err, force=True) == (2, 2)
        with pytest.raises(ValueError, match="must differ"):
            export.write_openai(s, job_id, out, tmp_path / "." / "output.jsonl", force=True)
        api_out, api_err = export_openai(s, job_id)
    assert [json.loads(x) for x in out.read_text().splitlines()] == api_out
    assert [json.loads(x) for x in err.read_text().splitlines()] == api_err
    assert [x["response"]["status_code"] for x in api_err] == [400, 500]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))    # no temporary left


# ---------------------------------------------------------------- CSV


def test_csv_has_one_flat_row_per_request(job):
    url, job_id, _ = job
    buf = io.StringIO()
    with db.session_factory(url, readonly=True).begin() as s:
        assert export.export_job(s, job_id, "csv", buf) == 5
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert list(rows[0]) == list(export.FLAT_COLUMNS)
    assert [r["custom_id"] for r in rows] == ["chat-ok", "ids-ok", "bad-request", "worker-died", "never-ran"]
    assert json.loads(rows[0]["token_ids"]) == [0, 1, 2] and rows[0]["completion_tokens"] == "3"
    assert json.loads(rows[0]["messages"])[1] == {"role": "user", "content": "Hi é", "name": "ann"}
    assert json.loads(rows[0]["metadata"]) == {"batch": "a", "topic": "greeting"}
    assert (rows[0]["model"], rows[0]["target"], json.loads(rows[0]["drafts"])) == ("gpt-4o-mini", "tgt-chat",
                                                                                    ["d-chat"])
    assert json.loads(rows[1]["prompt_ids"]) == [5, 6, 7] and rows[1]["prompt"] == ""
    assert rows[2]["error_type"] == "invalid_request_error" and rows[2]["text"] == ""


# ---------------------------------------------------------------- Parquet


def _parquet(url: str, job_id: str, path: Path, **kw) -> int:
    with db.session_factory(url, readonly=True).begin() as s:
        return export.export_job(s, job_id, "parquet", path, **kw)


def test_parquet_types(job, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    url, job_id, _ = job
    path = tmp_path / "out.parquet"
    assert _parquet(url, job_id, path) == 5
    schema = pq.read_schema(path)
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    assert schema.field("messages").type == message and schema.field("conversation").type == message
    assert schema.field("drafts").type == pa.list_(pa.string())
    assert schema.field("prompt_ids").type == pa.list_(pa.int64())
    assert schema.field("metadata").type == pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))
    params = schema.field("params").type
    assert {params.field(i).name: params.field(i).type for i in range(params.num_fields)} == {
        "max_new_tokens": pa.int64(), "temperature": pa.float64(), "top_p": pa.float64(), "top_k": pa.int64(),
        "seed": pa.int64(), "stop": pa.list_(pa.string()), "presence_penalty": pa.float64(),
        "frequency_penalty": pa.float64(), "repetition_penalty": pa.float64(), "min_p": pa.float64(), "n": pa.int64(),
        "logit_bias": pa.list_(pa.struct([("key", pa.string()), ("value", pa.float64())])),
        "structured": pa.struct([("kind", pa.string()), ("source", pa.string()), ("strict", pa.bool_())])}
    stats = schema.field("stats").type
    types = {stats.field(i).name: stats.field(i).type for i in range(stats.num_fields)}
    # every statistics field, typed: the CSV's columns and the three the SQL view adds
    assert list(types) == [*STATS_COLUMNS, "draft_steps", "accepted_at_position", "batch_size_seconds"]
    assert types["batch_size_seconds"] == pa.list_(pa.struct([("key", pa.string()), ("value", pa.float64())]))
    assert types["draft_steps"] == pa.int64() and types["accepted_at_position"] == pa.list_(pa.int64())
    assert types["pool_wins"] == pa.list_(pa.struct([("key", pa.string()), ("value", pa.int64())]))
    assert types["accepted_per_position"] == pa.list_(pa.float64())
    assert types["speculation_disabled"] == pa.bool_() and types["final_gamma"] == pa.int64()
    assert pa.string() not in (types[c] for c in STATS_COLUMNS)
    assert schema.field("finished_at").type == pa.timestamp("us", tz="UTC")
    assert not list(tmp_path.glob(".*.tmp"))                     # written atomically

    t = pq.read_table(path).to_pylist()
    assert t[0]["conversation"] == [
        {"role": "developer", "content": "You are terse.", "name": None},
        {"role": "user", "content": "Hi é", "name": "ann"},
        {"role": "assistant", "content": "out", "name": None}]
    assert t[0]["metadata"] == [{"key": "batch", "value": "a"}, {"key": "topic", "value": "greeting"}]
    assert t[0]["stats"]["pool_wins"] == [{"key": "d-chat", "value": 2}]
    assert t[0]["stats"]["batch_size_seconds"] == [{"key": "1", "value": 0.5}]
    assert t[0]["stats"]["draft_steps"] == 2 and t[0]["stats"]["accepted_at_position"] == [2, 1]
    assert t[1]["prompt_ids"] == [5, 6, 7] and t[1]["conversation"] is None     # a completion: prompt + text
    assert t[4]["stats"] is None and t[4]["text"] is None
    # the output's grammar, as the CSV's params carry it: which rows were constrained, and by what
    assert t[2]["params"]["structured"] == {"kind": "json", "source": '{"type": "object"}', "strict": True}
    assert t[0]["params"]["structured"] is None


def test_parquet_in_duckdb_and_pandas(job, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    pd = pytest.importorskip("pandas")
    url, job_id, _ = job
    path = tmp_path / "out.parquet"
    _parquet(url, job_id, path)
    row = duckdb.sql(f"SELECT custom_id, stats.acceptance_rate, map_from_entries(stats.pool_wins)['d-chat'], "
                     f"map_from_entries(metadata)['topic'], params.max_new_tokens, conversation[3].content "
                     f"FROM '{path}' WHERE status = 'completed' ORDER BY line_no LIMIT 1").fetchall()
    assert row[0] == ("chat-ok", 0.5, 2, "greeting", 8, "out")
    df = pd.read_parquet(path)
    assert list(df["custom_id"]) == ["chat-ok", "ids-ok", "bad-request", "worker-died", "never-ran"]
    assert str(df["finished_at"].dtype) == "datetime64[us, UTC]"


def test_parquet_loads_with_datasets_typed(job, tmp_path):
    datasets = pytest.importorskip("datasets")
    from datasets import List, Value

    url, job_id, _ = job
    path = tmp_path / "out.parquet"
    _parquet(url, job_id, path, statuses=["completed"])
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    f = ds.features
    assert f["messages"] == List({"role": Value("string"), "content": Value("string"), "name": Value("string")})
    assert f["conversation"] == f["messages"]
    assert f["stats"]["acceptance_rate"] == Value("float64") and f["stats"]["verify_steps"] == Value("int64")
    assert f["stats"]["pool_wins"] == List({"key": Value("string"), "value": Value("int64")})
    assert f["params"]["stop"] == List(Value("string")) and f["token_ids"] == List(Value("int64"))
    assert ds["custom_id"] == ["chat-ok", "ids-ok"]
    assert ds[0]["conversation"][-1] == {"role": "assistant", "content": "out", "name": None}


def test_conversation_column_passes_the_chat_template(job, tmp_path, tiny_models):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    url, job_id, _ = job
    path = tmp_path / "out.parquet"
    _parquet(url, job_id, path, statuses=["completed"])
    tok = AutoTokenizer.from_pretrained(tiny_models / "tok")
    conversations = [c for c in pq.read_table(path, columns=["conversation"]).column(0).to_pylist() if c]
    assert len(conversations) == 1
    text = tok.apply_chat_template(conversations[0], tokenize=False)
    assert text.endswith("<|im_start|>assistant\nout<|im_end|>\n") and "Hi é" in text


def test_empty_parquet_keeps_its_schema(job, tmp_path):
    import pyarrow.parquet as pq

    url, job_id, _ = job
    path = tmp_path / "none.parquet"
    assert _parquet(url, job_id, path, statuses=["cancelled"]) == 0
    assert pq.read_table(path).num_rows == 0
    assert pq.read_schema(path).names == pq.read_schema(_write_full(url, job_id, tmp_path)).names


def _write_full(url: str, job_id: str, tmp_path: Path) -> Path:
    path = tmp_path / "full.parquet"
    _parquet(url, job_id, path)
    return path


def test_export_refuses_to_overwrite_without_force(job, tmp_path):
    url, job_id, _ = job
    path = tmp_path / "out.parquet"
    path.write_text("keep me")
    with pytest.raises(export.ExportExists):
        _parquet(url, job_id, path)
    assert path.read_text() == "keep me"
    assert _parquet(url, job_id, path, force=True) == 5
    assert path.read_bytes()[:4] == b"PAR1"


def test_job_summary_lists_where_each_model_runs(job, tmp_path):
    url, job_id, _ = job
    with db.session_factory(url).begin() as s:
        store.create_job(s, target="other-job", drafts=[], params={}, queue="q2", requests=[
            intake.ParsedRequest(1, "x", "completion", "p", None, {}, model="gpt-4o-mini")])  # not counted
        routes = store.job_summary(s, job_id)["models"]
    assert routes == [
        {"model": "babbage-002", "target": "tgt", "drafts": [], "drafters": [], "requests": 3},
        {"model": "gpt-4o-mini", "target": "tgt-chat", "drafts": ["d-chat"], "drafters": ["d-chat"], "requests": 2}]


def test_a_jobs_drafters_that_load_no_model_are_shown_on_every_route(db_url):
    """qa55: with --model-map and --ngram, status read 'other: tgt' (plain decoding, it seemed) and
    'gpt-4o-mini: tgt-chat <- d-chat' while both routes drafted with the n-gram drafter too."""
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1", "ngram"], params={}, queue="q", requests=[
            intake.ParsedRequest(1, "a", "completion", "p", None, {}),
            intake.ParsedRequest(2, "b", "completion", "p", None, {}, model="m", target="tgt-chat", drafts=["d-chat"]),
            intake.ParsedRequest(3, "c", "completion", "p", None, {}, model="other", target="tgt", drafts=[])]).id
        routes = store.job_summary(s, job_id)["models"]
    assert [(r["model"], r["drafts"], r["drafters"]) for r in routes] == [
        (None, ["d1"], ["d1", "ngram"]), ("m", ["d-chat"], ["d-chat", "ngram"]), ("other", [], ["ngram"])]


def test_an_export_sweeps_temporary_files_a_killed_export_left(job, tmp_path):
    """A SIGKILLed export leaves ``.NAME.PID.tmp`` beside its output; the next export into that
    directory removes ours once an hour old, and nothing else."""
    import os
    import time

    url, job_id, _ = job
    out = tmp_path / "out"
    out.mkdir()
    stale = out / ".answers.jsonl.4242.tmp"
    fresh = out / ".other.jsonl.4343.tmp"         # an export running right now
    mine_not = out / ".answers.jsonl.tmp"          # not our pattern
    for p in (stale, fresh, mine_not):
        p.write_text("partial")
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    os.utime(mine_not, (hours_ago, hours_ago))
    with db.session_factory(url).begin() as s:
        export.export_job(s, job_id, "csv", out / "answers.csv")
    assert not stale.exists() and fresh.exists() and mine_not.exists()
    assert (out / "answers.csv").exists()


def test_the_formats_doc_lists_every_parquet_column_and_param():
    """docs/FORMATS.md's Parquet table is what a dataset builder reads: every column of the schema
    is in it (``lossy`` was not), and the ``params`` row names every field of the struct."""
    import re

    from specbatch.jobs.table import parquet_schema

    doc = (Path(__file__).parents[2] / "docs" / "FORMATS.md").read_text()
    table = doc.split("## Parquet:", 1)[1].split("\n\n", 2)[1]
    rows = [line.split(" | ", 1) for line in table.splitlines() if line.startswith("| `")]
    listed = [name for first, _ in rows for name in re.findall(r"`([a-z_]+)`", first)]
    schema = parquet_schema()
    assert sorted(listed) == sorted(schema.names)
    params_row = next(rest for first, rest in rows if first == "| `params`")
    params = schema.field("params").type
    assert [params.field(i).name for i in range(params.num_fields)
            if not re.search(rf"\b{params.field(i).name} ", params_row)] == []
