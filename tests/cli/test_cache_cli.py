"""`specbatch run` twice, `--no-cache`, `cache stats|clear` and the export's `cached` column, through the CLI."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch import db
from specbatch.cli.main import cli


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:9/0")
    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path / "cache"))
    yield
    db.forget_engines()


def sb(*args: str) -> dict | str:
    result = CliRunner().invoke(cli, list(args), obj={}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.stdout
    return json.loads(out[out.index("{"):]) if "--json" in args else out


def test_cache_commands(tmp_path: Path, tiny_models: Path) -> None:
    # the README's commands, on a copy of the tiny target named like the default one
    target = tmp_path / "smollm2-135m"
    shutil.copytree(tiny_models / "llama", target)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"custom_id": f"q{i}", "prompt": p, "max_tokens": 6}
            for i, p in enumerate(["The quick brown fox", "def fibonacci(n):", "The quick brown fox"])]
    rows.append({"custom_id": "s", "prompt": "hello", "max_tokens": 6, "temperature": 0.8, "seed": 1})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair = ["--target", str(target), "--draft", str(tiny_models / "llama-partial")]

    first = sb("run", str(prompts), *pair, "--json")
    assert (first["stats"]["cache_hits"], first["status"]) == (1, "completed")   # the repeated line
    second = sb("run", str(prompts), *pair, "--batch-size", "2", "--json")
    assert second["stats"]["cache_hits"] == 3                  # every greedy line; sampled ones never
    assert 0 < second["stats"]["tokens_generated"] <= 6
    again = sb("run", str(prompts), *pair, "--no-cache", "--json")
    assert again["stats"]["cache_hits"] == 0 and again["stats"]["tokens_generated"] > 6

    stats = sb("cache", "stats", "--json")
    assert (stats["entries"], stats["hits"]) == (2, 4)
    assert stats["targets"][0]["names"] == [str(target)]
    assert "2 entries, 4 hits served" in sb("cache", "stats")

    table = list(csv.DictReader(io.StringIO(sb("export", second["id"], "-f", "csv"))))
    assert [r["cached"] for r in table] == ["True", "True", "True", "False"]
    jsonl = [json.loads(x) for x in sb("export", first["id"]).splitlines()]
    assert [x["response"]["body"]["specbatch"]["cached"] for x in jsonl] == [False, False, True, False]

    assert sb("cache", "clear", "--target", "smollm2-135m").strip() == "no cache entries for target smollm2-135m"
    assert sb("cache", "clear", "--target", "smolm2-135m").strip() == (
        "no cache entries for target smolm2-135m (did you mean smollm2-135m?)")
    assert sb("cache", "clear", "--target", str(target), "--json")["cleared"] == 2
    assert sb("cache", "stats", "--json")["entries"] == 0
    third = sb("run", str(prompts), *pair, "--json")
    assert third["stats"]["cache_hits"] == 1                   # only the in-file duplicate again
    assert "cleared 2 cache entries" in sb("cache", "clear")


def test_help_lists_no_cache_on_run_and_submit() -> None:
    for command in ("run", "submit"):
        assert "--no-cache" in sb(command, "--help")
    assert "stats" in sb("cache", "--help") and "--target" in sb("cache", "clear", "--help")


def test_prefix_cache_on_and_off_through_run_status_and_export(tmp_path: Path, tiny_models: Path) -> None:
    # the README's `--no-prefix-cache` command, on a copy of the tiny target named like the default one
    target = tmp_path / "smollm2-135m"
    shutil.copytree(tiny_models / "llama", target)
    prompts = tmp_path / "prompts.jsonl"
    system = "You answer questions about the dishwasher manual. " * 3
    rows = [{"custom_id": f"q{i}", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": q}], "max_tokens": 6}
            for i, q in enumerate(["How do I clean it?", "What is E15?", "Where do cups go?"])]
    rows.append({"custom_id": "other", "prompt": "def fibonacci(n):", "max_tokens": 6})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair = ["--target", str(target), "--draft", str(tiny_models / "llama-partial"), "--no-cache"]

    on = sb("run", str(prompts), *pair, "--json")
    off = sb("run", str(prompts), *pair, "--no-prefix-cache", "--json")
    pc = on["stats"]["prefix_cache"]
    assert pc["requests"] == 2 and pc["cached_prompt_tokens"] > 0          # the first computes it
    assert off["stats"]["prefix_cache"]["cached_prompt_tokens"] == 0
    texts = {}
    for job in (on, off):
        lines = [json.loads(x) for x in sb("export", job["id"]).splitlines()]
        texts[job["id"]] = [x["response"]["body"]["choices"][0] for x in lines]
        cached = [x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in lines]
        assert (sum(c > 0 for c in cached) == 2) == (job is on) and cached[3] == 0
    assert texts[on["id"]] == texts[off["id"]]
    assert "prefix cache" in sb("status", on["id"]) and "prefix cache" not in sb("status", off["id"])
