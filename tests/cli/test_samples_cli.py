"""``n`` samples per line through `specbatch run`, `status`, `export` (JSONL, CSV, Parquet) and
`audit`: one request per line, one results row per sample, N choices in the OpenAI line."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch import db
from specbatch.cli.main import cli
from specbatch.config import get_settings
from tests.jobs.test_export import check_line

LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Write a haiku"}], "max_tokens": 8,
              "temperature": 1.0, "seed": 5, "n": 3, "logprobs": True, "top_logprobs": 1}},
    {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 6, "n": 2,
              "temperature": 0}},     # greedy asked for: two copies of one text (unset, n 2 is refused)
    {"custom_id": "plain", "prompt": "The quick brown fox", "max_tokens": 5},
]


@pytest.fixture
def ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_models: Path):
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    result = CliRunner().invoke(cli, ["run", str(path), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial"), "--json",
                                      "--batch-size", "8"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    yield summary
    get_settings.cache_clear()
    db.forget_engines()


def sb(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_line_is_one_request_with_n_results(ran):
    # requests are lines: status counts 3, not the 6 samples
    assert ran["status"] == "completed" and ran["request_counts"]["completed"] == 3
    assert ran["request_counts"]["total"] == 3
    assert ran["stats"]["results"] == 6
    status = json.loads(sb("status", ran["id"], "--json"))
    assert status["request_counts"]["total"] == 3
    # the table's per-worker column counts results rows (6), so it must not be headed "requests"
    # beside "requests total 3"
    table = sb("status", ran["id"])
    header = next(line for line in table.splitlines() if "busy tokens/s" in line)
    assert header.split()[:2] == ["worker", "results"], table


def test_openai_lines_carry_n_choices_and_usage_as_openai_sums_it(ran):
    lines = {x["custom_id"]: x for x in map(json.loads, sb("export", ran["id"]).splitlines())}
    for line in lines.values():
        check_line(line)                                     # openai's ChatCompletion / Completion
    chat = lines["chat"]["response"]["body"]
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in chat["choices"]]
    assert len(set(texts)) == 3                              # seeded samples differ
    assert all(len(c["logprobs"]["content"]) > 0 for c in chat["choices"])
    assert len(chat["specbatch"]["samples"]) == 3                       # each sample's statistics
    rows = [r for r in csv.DictReader(io.StringIO(sb("export", ran["id"], "-f", "csv"))) if r["custom_id"] == "chat"]
    per_sample = [int(r["completion_tokens"]) for r in rows]
    assert [len(c["logprobs"]["content"]) for c in chat["choices"]] == per_sample
    assert chat["usage"]["completion_tokens"] == sum(per_sample)
    assert chat["usage"]["prompt_tokens"] == int(rows[0]["prompt_tokens"]) > 0     # the prompt once
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + sum(per_sample)
    comp = lines["comp"]["response"]["body"]
    assert [c["index"] for c in comp["choices"]] == [0, 1]
    assert comp["choices"][0]["text"] == comp["choices"][1]["text"]      # greedy: n identical texts
    assert len(lines["plain"]["response"]["body"]["choices"]) == 1


def test_csv_and_parquet_hold_one_row_per_sample(ran, tmp_path: Path):
    import pyarrow.parquet as pq

    rows = list(csv.DictReader(io.StringIO(sb("export", ran["id"], "-f", "csv"))))
    assert [(r["custom_id"], r["sample_index"]) for r in rows] == [
        ("chat", "0"), ("chat", "1"), ("chat", "2"), ("comp", "0"), ("comp", "1"), ("plain", "0")]
    sb("export", ran["id"], "-f", "parquet", "-o", str(tmp_path / "out.parquet"))
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [(r["custom_id"], r["sample_index"]) for r in table] == [
        (r["custom_id"], int(r["sample_index"])) for r in rows]
    assert [r["params"]["n"] for r in table] == [3, 3, 3, 2, 2, 1]
    assert [r["text"] for r in table] == [r["text"] for r in rows]
    # the worker sized the batch in rows (6 samples), not requests (3): all decoded together
    sizes = {int(e["key"]) for r in table for e in r["stats"]["batch_size_seconds"]}
    assert max(sizes) == 6, sizes


def test_audit_checks_every_sample(ran):
    report = json.loads(sb("audit", ran["id"], "--json"))
    assert (report["audited"], report["failed"]) == (6, 0)
    assert [(r["custom_id"], r["sample_index"]) for r in report["requests"]] == [
        ("chat", 0), ("chat", 1), ("chat", 2), ("comp", 0), ("comp", 1), ("plain", 0)]
