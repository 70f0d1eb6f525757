"""Export: OpenAI batch output JSONL + stats, CSV, Parquet that pandas (and datasets) read back."""

from __future__ import annotations

import csv
import io
import json

import pytest

from specbatch import db
from specbatch.jobs import export, store
from specbatch.jobs.intake import ParsedRequest
from tests.jobs.test_store import PARAMS, output


@pytest.fixture
def job(db_url) -> tuple[str, str]:
    """Four requests: completed (completion), completed (chat), failed, pending."""
    reqs = [
        ParsedRequest(1, "done-text", "completion", "Once upon", None, PARAMS),
        ParsedRequest(2, "done-chat", "chat", None, [{"role": "user", "content": "Hi é"}], PARAMS),
        ParsedRequest(4, "broken", "completion", "x", None, PARAMS),
        ParsedRequest(5, "waiting", "completion", "y", None, PARAMS),
    ]
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], ngram=False, params={}, requests=reqs,
                                  queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids[:3], "w1", 60, 3)
        store.record_result(s, ids[0], output(new_tokens=3), "w1")
        store.record_result(s, ids[1], output(new_tokens=2), "w1")
        store.record_failure(s, ids[2], "prompt is longer than the model's context", "w1")
        store.refresh_job(s, job_id)
    return db_url, job_id


def _export(url: str, job_id: str, fmt: str, **kw) -> str:
    buf = io.StringIO()
    with db.session_factory(url, readonly=True).begin() as s:
        export.export_job(s, job_id, fmt, buf, **kw)
    return buf.getvalue()


def test_jsonl_follows_the_openai_batch_output_shape(job):
    url, job_id = job
    lines = [json.loads(x) for x in _export(url, job_id, "jsonl").splitlines()]
    assert [x["custom_id"] for x in lines] == ["done-text", "done-chat", "broken", "waiting"]
    text, chat, broken, waiting = lines
    body = text["response"]["body"]
    assert text["error"] is None and text["response"]["status_code"] == 200
    assert body["object"] == "text_completion" and body["model"] == "tgt"
    assert body["choices"] == [{"index": 0, "text": "out", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "out"}
    stats = text["stats"]
    for key in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds", "verify_seconds",
                "wall_seconds", "tokens_per_second", "pool_wins", "worker", "latency_seconds"):
        assert key in stats
    assert (stats["acceptance_rate"], stats["tokens_per_second"]) == (0.5, 6.0)
    assert broken["response"] is None and broken["stats"] is None
    assert broken["error"] == {"code": "failed", "message": "prompt is longer than the model's context"}
    assert waiting["error"]["code"] == "pending" and waiting["status"] == "pending"


def test_status_filter(job):
    url, job_id = job
    got = [json.loads(x)["custom_id"] for x in _export(url, job_id, "jsonl", statuses=["completed"]).splitlines()]
    assert got == ["done-text", "done-chat"]
    got = [json.loads(x)["custom_id"] for x in
           _export(url, job_id, "jsonl", statuses=["failed", "pending"]).splitlines()]
    assert got == ["broken", "waiting"]
    with pytest.raises(ValueError, match="unknown status"):
        _export(url, job_id, "jsonl", statuses=["done"])


def test_csv_has_one_flat_row_per_request(job):
    url, job_id = job
    rows = list(csv.DictReader(io.StringIO(_export(url, job_id, "csv"))))
    assert list(rows[0]) == list(export.FLAT_COLUMNS)
    assert [r["custom_id"] for r in rows] == ["done-text", "done-chat", "broken", "waiting"]
    assert json.loads(rows[0]["token_ids"]) == [0, 1, 2] and rows[0]["completion_tokens"] == "3"
    assert json.loads(rows[1]["messages"]) == [{"role": "user", "content": "Hi é"}]
    assert rows[2]["error"].startswith("prompt is longer") and rows[2]["text"] == ""


def test_parquet_reads_back_with_pandas(job, tmp_path):
    pd = pytest.importorskip("pandas")
    url, job_id = job
    path = tmp_path / "out.parquet"
    with db.session_factory(url, readonly=True).begin() as s:
        assert export.export_job(s, job_id, "parquet", path) == 4
    df = pd.read_parquet(path)
    assert list(df.columns) == list(export.FLAT_COLUMNS)
    assert list(df["custom_id"]) == ["done-text", "done-chat", "broken", "waiting"]
    assert list(df["token_ids"][0]) == [0, 1, 2] and df["token_ids"][3] is None
    assert df["completion_tokens"][0] == 3 and pd.isna(df["completion_tokens"][2])
    assert list(df["accepted_per_position"][0]) == [0.5, 0.25]
    assert str(df["finished_at"].dtype) == "datetime64[us, UTC]"
    assert not list(tmp_path.glob(".*.tmp"))                    # written atomically


def test_empty_parquet_keeps_its_schema(job, tmp_path):
    pd = pytest.importorskip("pandas")
    url, job_id = job
    path = tmp_path / "none.parquet"
    with db.session_factory(url, readonly=True).begin() as s:
        assert export.export_job(s, job_id, "parquet", path, statuses=["cancelled"]) == 0
    df = pd.read_parquet(path)
    assert len(df) == 0 and list(df.columns) == list(export.FLAT_COLUMNS)


def test_parquet_loads_with_datasets(job, tmp_path):
    datasets = pytest.importorskip("datasets")
    url, job_id = job
    path = tmp_path / "out.parquet"
    with db.session_factory(url, readonly=True).begin() as s:
        export.export_job(s, job_id, "parquet", path)
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert ds["custom_id"] == ["done-text", "done-chat", "broken", "waiting"]
