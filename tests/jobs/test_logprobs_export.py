"""Log-probabilities from intake to export: a chat line (logprobs + top_logprobs) and a completion
line (logprobs) decoded by the engine, stored packed, exported as OpenAI's shapes (parsed by the
openai package's types), and as typed Parquet list columns."""

from __future__ import annotations

import csv
import json

import pytest

from specbatch import db
from specbatch.config import Settings
from specbatch.engine import Engine
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model
from specbatch.engine.types import TokenLogprob
from specbatch.jobs import export, intake, logprobs, store
from tests.jobs.test_export import check_line

FILE = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Write a haiku"}], "max_tokens": 6,
              "logprobs": True, "top_logprobs": 3}},
    {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 5, "logprobs": 2}},
    {"custom_id": "plain", "prompt": "Hi", "max_tokens": 3},
]


@pytest.fixture
def job(db_url, tmp_path, tiny_models):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in FILE))
    parsed = intake.read_file(path, {}, Settings(database_url=db_url))
    engine = Engine(load_model(str(tiny_models / "llama")),
                    [load_model(str(tiny_models / "llama-partial")), NGRAM])
    outs = {}
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="t", drafts=["d", "ngram"], params={}, requests=parsed.requests,
                                  queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w", 60, 3)
        for rid, req in zip(ids, parsed.requests):
            out = engine.generate(prompt=req.prompt, messages=req.messages, params=req.generation_params())
            store.record_result(s, rid, out, "w")
            outs[req.custom_id] = out
        store.refresh_job(s, job_id)
    return db_url, job_id, outs


def test_pack_round_trip():
    lps = [TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0)), b"ab", (b"ab", b"\xe2\x80")),
           TokenLogprob(7, -1.5, ((3, -0.5), (7, -1.5)), b"", (b"x", b""))]
    assert logprobs.unpack(logprobs.pack(lps)) == lps
    assert logprobs.unpack(logprobs.pack([])) == []


def test_openai_lines_carry_the_engines_logprobs(job):
    url, job_id, outs = job
    import io

    buf = io.StringIO()
    with db.session_factory(url, readonly=True).begin() as s:
        export.write_openai(s, job_id, buf)
    lines = {x["custom_id"]: x for x in map(json.loads, buf.getvalue().splitlines())}
    for line in lines.values():
        check_line(line)                       # ChatCompletion / Completion, logprobs included
    chat = lines["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    want = outs["chat"].logprobs
    assert [c["logprob"] for c in chat] == pytest.approx([t.logprob for t in want], abs=1e-6)
    assert all(len(c["top_logprobs"]) == 3 for c in chat)
    # the bytes are the tokens' own (a token may hold part of a character): they decode to the text
    assert b"".join(bytes(c["bytes"]) for c in chat).decode("utf-8", errors="replace") == outs["chat"].text
    assert chat[0]["top_logprobs"][0]["logprob"] >= chat[0]["top_logprobs"][-1]["logprob"]
    comp = lines["comp"]["response"]["body"]["choices"][0]["logprobs"]
    assert "".join(comp["tokens"]) == outs["comp"].text
    assert comp["token_logprobs"] == pytest.approx([t.logprob for t in outs["comp"].logprobs], abs=1e-6)
    assert comp["text_offset"][0] == 0 and all(len(d) <= 2 for d in comp["top_logprobs"])
    assert lines["plain"]["response"]["body"]["choices"][0]["logprobs"] is None


def test_parquet_and_csv_columns(job, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    url, job_id, outs = job
    with db.session_factory(url, readonly=True).begin() as s:
        export.export_job(s, job_id, "parquet", tmp_path / "out.parquet")
        export.export_job(s, job_id, "csv", tmp_path / "out.csv")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("logprobs").type == pa.list_(pa.float64())
    rows = {r["custom_id"]: r for r in table.to_pylist()}
    assert rows["comp"]["logprobs"] == pytest.approx([t.logprob for t in outs["comp"].logprobs], abs=1e-6)
    assert [x["token_id"] for x in rows["chat"]["top_logprobs"][0]] == [i for i, _ in outs["chat"].logprobs[0].top]
    assert rows["plain"]["logprobs"] is None and rows["plain"]["top_logprobs"] is None
    with open(tmp_path / "out.csv", newline="") as fp:
        assert "logprobs" not in next(csv.DictReader(fp))     # CSV mirrors the SQL view: no logprobs
