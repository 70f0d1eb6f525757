"""`specbatch run` with the throughput autopilot (the default) on tiny models; bad throughput
options are usage errors (exit 2) that write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    get_settings.cache_clear()


def _prompts(tmp_path: Path, n: int = 14) -> Path:
    words = ["The quick brown fox", "def fibonacci(n):", "SELECT id FROM", "Once upon a time", "Write a haiku"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": f"{words[i % 5]} {i}",
                                        "max_tokens": 8 + 3 * (i % 4)}) + "\n" for i in range(n)))
    return path


def _run(args: list[str]) -> dict:
    get_settings.cache_clear()
    # --no-cache: each run must decode (a results-cache hit records no batching at all)
    result = CliRunner().invoke(cli, ["run", *args, "--no-cache", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):])


def _tokens(job_id: str) -> dict[str, list[int]]:
    from specbatch.db import session_factory
    from specbatch.db.models import Request, Result

    get_settings.cache_clear()
    with session_factory(get_settings().database_url).begin() as s:
        rows = s.query(Request.custom_id, Result.token_ids).join(Result, Result.request_id == Request.id) \
            .filter(Request.job_id == job_id).all()
    return {cid: list(toks) for cid, toks in rows}


def test_run_auto_equals_batch_one_and_records_the_choice(tmp_path: Path, tiny_models: Path) -> None:
    prompts = _prompts(tmp_path)
    models = ["--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial")]
    auto = _run([str(prompts), *models, "--threads", "1"])           # --batch-size auto is the default
    one = _run([str(prompts), *models, "--batch-size", "1"])
    plain = _run([str(prompts), *models, "--no-speculation", "--max-memory", "512MiB"])
    for summary in (auto, one, plain):
        assert summary["status"] == "completed" and summary["request_counts"]["completed"] == 14
    assert _tokens(auto["id"]) == _tokens(one["id"]) == _tokens(plain["id"])

    b = auto["stats"]["batching"]
    assert abs(sum(b["batch_size_share"].values()) - 1) < 1e-6
    assert max(int(k) for k in b["batch_size_share"]) > 1      # it grew the batch
    # a job this small may end before a speculation trial is affordable (autopilot._affordable)
    assert 0 <= b["speculative_step_share"] <= 1
    assert b["decode_tokens_per_second"] > 0
    assert set(one["stats"]["batching"]["batch_size_share"]) == {"1"}
    assert plain["stats"]["batching"]["speculative_step_share"] == 0
    assert plain["drafts"] == []

    get_settings.cache_clear()
    status = CliRunner().invoke(cli, ["status", auto["id"]])
    assert status.exit_code == 0, status.output
    assert "batch sizes" in status.output and "speculated" in status.output


@pytest.mark.parametrize("command", ["run", "worker"])
@pytest.mark.parametrize("option,value,message", [
    ("--batch-size", "0", "must be an integer >= 1 or 'auto'"),
    ("--batch-size", "-3", "must be an integer >= 1 or 'auto'"),
    ("--batch-size", "2.5", "must be an integer >= 1 or 'auto'"),
    ("--batch-size", "lots", "must be an integer >= 1 or 'auto'"),
    ("--max-memory", "plenty", "is not a size"),
    ("--max-memory", "0GB", "must be above 0"),
    ("--threads", "0", "--threads"),
])
def test_bad_throughput_options_exit_2(tmp_path: Path, command: str, option: str, value: str,
                                       message: str) -> None:
    args = [command, *([str(_prompts(tmp_path, 1))] if command == "run" else []), option, value]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and option in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "specbatch.db").exists()   # nothing written


def test_draft_none_cannot_be_mixed(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path, 1)), "--draft", "none", "--draft", "x"])
    assert result.exit_code == 2 and "'none'" in result.output


@pytest.mark.parametrize(("drafts", "drafted", "said"), [(["d"], 0, "none of 10 steps drafted"),
                                                       (["d"], 2, "drafted on 2 of 10 steps"),
                                                       (["d"], 6, None), ([], 0, None)])
def test_run_summary_says_why_a_draft_never_drafted(drafts, drafted, said, capsys, monkeypatch):
    """A first run whose autopilot kept plain steps showed 'speculated 0% of steps' and no reason."""
    from specbatch.cli.queue import _print_summary
    from specbatch.config import Settings

    monkeypatch.setenv("COLUMNS", "200")
    summary = {"id": "j1", "status": "completed", "target": "t", "drafts": drafts,
               "request_counts": {"total": 1, "completed": 1}, "failures": [],
               "stats": {"results": 1, "batching": {"batch_size_share": {"8": 1.0}},
                         "speculation": {"steps": 10, "drafted_steps": drafted}}}
    _print_summary(summary, Settings.from_env({}))
    out = " ".join(capsys.readouterr().out.split())
    assert ("speculation" in out) is (said is not None), out
    assert said is None or said in out, out


def test_run_summary_shows_a_dash_for_a_statistic_with_no_value(capsys, monkeypatch):
    """A run cancelled before any token: its rate and grammar share are None, printed as 'None'."""
    from specbatch.cli.queue import _print_summary
    from specbatch.config import Settings

    monkeypatch.setenv("COLUMNS", "200")
    summary = {"id": "j1", "status": "cancelled", "target": "t", "drafts": [],
               "request_counts": {"total": 2, "cancelled": 2}, "failures": [],
               "stats": {"results": 0, "tokens_per_second": None, "grammar_token_share": None}}
    _print_summary(summary, Settings.from_env({}))
    out = capsys.readouterr().out
    assert "None" not in out and "tokens_per_second" in out, out


@pytest.mark.parametrize("drafted", [0, 5])
def test_run_summary_shows_grammar_rows_only_where_a_grammar_drafted(drafted, capsys, monkeypatch):
    """qa50: three grammar_* zeros on every job, structured or not, read as noise."""
    from specbatch.cli.queue import _print_summary
    from specbatch.config import Settings

    monkeypatch.setenv("COLUMNS", "200")
    summary = {"id": "j1", "status": "completed", "target": "t", "drafts": [],
               "request_counts": {"total": 1, "completed": 1}, "failures": [],
               "stats": {"results": 1, "tokens_generated": 9, "grammar_drafted_tokens": drafted,
                         "grammar_accepted_tokens": drafted, "grammar_token_share": drafted / 9}}
    _print_summary(summary, Settings.from_env({}))
    out = capsys.readouterr().out
    assert "tokens_generated" in out and ("grammar_" in out) is (drafted > 0), out


def test_run_says_at_its_end_when_other_processes_held_the_cores(tmp_path: Path, tiny_models: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on a shared machine slower than the last said nothing of why: its thread governor
    (engine/contention.py) now says, after the run, how long it decoded on fewer threads. Here
    the governor is a scripted one whose machine is always contended."""
    from specbatch.engine import Engine
    from specbatch.engine.contention import WINDOW, Contention

    governors: list[Contention] = []

    def contended(self: Engine, lanes: int) -> Contention:
        if self.contention is None:
            self.contention = Contention(2, set_threads=lambda n: None)
            real = self.contention.observe
            self.contention.observe = lambda wall, cpu: real(1.0, 0.5 * self.contention.now)   # type: ignore[method-assign]
            governors.append(self.contention)
        return self.contention

    monkeypatch.setattr(Engine, "_contention", contended)
    prompts = _prompts(tmp_path, n=4)
    m = str(tiny_models / "llama")
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", m, "--draft", "none", "--no-cache"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (g,) = governors
    assert g.steps > WINDOW and g.fewer == g.steps - WINDOW   # every step after the first window
    assert f"specbatch: other processes held this machine's cores: decoded on 1 of 2 torch threads for " \
           f"{g.fewer / g.steps:.0%} of {g.steps} decode steps and prefill forwards" \
           in " ".join(result.stderr.split()), result.stderr
