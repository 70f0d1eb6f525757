"""The CLI as a whole: every command is registered, has --help with an example, --json where it
reports; exit codes 0/1/2; job-default options on submit and run reach the stored job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from specbatch.cli.main import COMMAND_MODULES, cli

REPO = Path(__file__).resolve().parents[2]
ISSUE_COMMANDS = {"submit", "run", "worker", "status", "jobs", "export", "cancel", "retry", "resume",
                  "generate", "bench", "db", "models", "flower"}
# commands that report something, so they take --json ("db" is a group: its subcommands do)
REPORTING = ("submit", "run", "status", "jobs", "export", "cancel", "retry", "resume", "generate",
             "models", "bench", "db upgrade", "db url", "cache stats", "cache clear", "audit")
NOT_REPORTING = ("worker", "flower", "serve")  # long-running processes with their own logs


def _all_commands() -> list[str]:
    out = []
    for name in sorted(n for names in COMMAND_MODULES.values() for n in names):
        cmd = cli.get_command(click.Context(cli), name)
        out.append(name)
        if isinstance(cmd, click.Group):
            out += [f"{name} {sub}" for sub in cmd.list_commands(click.Context(cmd))]
    return out


def _command(path: str) -> click.Command:
    cmd: click.Command = cli
    for word in path.split():
        assert isinstance(cmd, click.Group)
        sub = cmd.get_command(click.Context(cmd), word)
        assert sub is not None, f"no command {path!r}"
        cmd = sub
    return cmd


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:9/0")  # nothing listens there


def test_every_issue_command_is_registered() -> None:
    top = set(cli.list_commands(click.Context(cli)))
    assert ISSUE_COMMANDS <= top, ISSUE_COMMANDS - top
    assert "upgrade" in _command("db").list_commands(click.Context(_command("db")))  # type: ignore[attr-defined]
    for name in top:
        assert cli.get_command(click.Context(cli), name) is not None, name


@pytest.mark.parametrize("path", _all_commands())
def test_help_has_an_example(path: str) -> None:
    result = CliRunner().invoke(cli, [*path.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output, f"`specbatch {path} --help` shows no example"
    example = result.output[result.output.index("Example"):]
    assert f"specbatch {path.split()[0]}" in example or "specbatch" in example


def test_every_command_that_takes_a_job_names_it_job_in_its_usage() -> None:
    """README and every error say JOB (an id or a unique prefix); one usage line saying JOB_ID made
    `resume` look as if it wanted something else."""
    takes_job = [p for p in _all_commands()
                 if any(isinstance(x, click.Argument) and x.name == "job_id" for x in _command(p).params)]
    assert {"status", "export", "cancel", "retry", "resume", "audit"} <= set(takes_job)
    for path in takes_job:
        usage = CliRunner().invoke(cli, [*path.split(), "--help"], prog_name="specbatch").output.splitlines()[0]
        assert usage == f"Usage: specbatch {path} [OPTIONS] JOB", usage


def test_every_option_says_what_it_does() -> None:
    """`serve --help` listed --port and --log-level with nothing but their defaults."""
    bare = [f"{path} {p.opts[0]}" for path in _all_commands() for p in _command(path).params
            if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert not bare, bare


def test_reporting_commands_take_json() -> None:
    assert set(REPORTING) | set(NOT_REPORTING) >= {p for p in _all_commands() if p not in ("db", "cache")}
    for path in REPORTING:
        opts = {o for p in _command(path).params for o in p.opts}
        assert "--json" in opts, f"`specbatch {path}` reports but has no --json"


def test_top_level_help_version_and_console_script() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ISSUE_COMMANDS:
        assert name in result.output
    assert CliRunner().invoke(cli, ["--version"]).exit_code == 0
    # the installed console script (pyproject [project.scripts]) is the same entry point
    proc = subprocess.run([Path(sys.executable).with_name("specbatch"), "--help"], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0 and not Path(sys.executable).with_name("specbatch").exists():
        proc = subprocess.run(["specbatch", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: specbatch" in proc.stdout


# ---------------------------------------------------------------- exit codes


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["no-such-command"]).exit_code == 2
    assert runner.invoke(cli, ["status"]).exit_code == 2                       # missing JOB
    assert runner.invoke(cli, ["jobs", "--limit", "0"]).exit_code == 2
    assert runner.invoke(cli, ["run", str(tmp_path / "missing.jsonl")]).exit_code == 2
    assert runner.invoke(cli, ["export", "abcd", "-f", "xml"]).exit_code == 2
    assert runner.invoke(cli, ["generate", "--prompt", "a", "--message", "b"]).exit_code == 2
    # option values checked by specbatch, not click: exit 1 before (qa51), as if a run had failed
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "x"}\n')
    bad_map = runner.invoke(cli, ["run", str(ok), "--target", "org/unused", "--model-map", "a"])
    assert bad_map.exit_code == 2 and "--model-map: 'a': expected NAME=TARGET" in bad_map.output, bad_map.output
    assert runner.invoke(cli, ["audit", "abcd", "--sample", "0"]).exit_code == 2


def test_domain_error_is_one_line_exit_1_and_debug_shows_the_trace() -> None:
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0     # a database without that job
    result = CliRunner().invoke(cli, ["status", "nosuchjob"])
    assert result.exit_code == 1
    lines = [x for x in result.output.splitlines() if x.startswith("Error")]
    assert len(lines) == 1 and "nosuchjob" in lines[0], result.output
    assert "Traceback" not in result.output
    debug = CliRunner().invoke(cli, ["--debug", "status", "nosuchjob"])
    assert debug.exit_code == 1 and debug.exception is not None
    assert type(debug.exception).__name__ == "JobNotFound"


def test_invalid_prompt_file_exits_1_listing_every_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "prompt": "x", "temperature": -1}\nnot json\n')
    result = CliRunner().invoke(cli, ["run", str(bad), "--target", "org/unused"])
    assert result.exit_code == 1
    assert "bad.jsonl:1" in result.output and "bad.jsonl:2" in result.output
    assert "Traceback" not in result.output


def test_bad_job_default_is_a_readable_error(tmp_path: Path) -> None:
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(cli, ["run", str(ok), "--target", "org/unused", "--top-p", "3"])
    assert result.exit_code == 2 and "'--top-p'" in result.output, result.output   # a usage error


# ---------------------------------------------------------------- job defaults reach the job


def _stored(job_id: str) -> tuple[dict, list[dict]]:
    from specbatch.config import get_settings
    from specbatch.db import session_factory
    from specbatch.jobs import store

    get_settings.cache_clear()
    with session_factory(get_settings().database_url).begin() as s:
        job = store.get_job(s, job_id)
        from sqlalchemy import select

        from specbatch.db.models import Request

        reqs = s.scalars(select(Request).where(Request.job_id == job.id).order_by(Request.line_no)).all()
        return dict(job.params), [dict(r.params) for r in reqs]


DEFAULT_OPTIONS = ["--max-tokens", "5", "--temperature", "0", "--top-p", "0.9", "--top-k", "7", "--seed", "3",
                   "--stop", "\n\n", "--stop", "###"]


def _two_lines(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt": "The quick brown fox"}) + "\n"
                    + json.dumps({"custom_id": "b", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3, "stop": "x"}) + "\n")
    return path


def _check_defaults(job_params: dict, request_params: list[dict]) -> None:
    assert job_params["max_new_tokens"] == 5 and job_params["stop"] == ["\n\n", "###"]
    a, b = request_params
    assert (a["max_new_tokens"], a["top_p"], a["top_k"], a["seed"], a["stop"]) == (5, 0.9, 7, 3, ["\n\n", "###"])
    assert (b["max_new_tokens"], b["stop"], b["top_k"]) == (3, ["x"], 7)   # the line wins over the default


def test_run_takes_every_job_default(tmp_path: Path, tiny_models: Path) -> None:
    result = CliRunner().invoke(cli, ["run", str(_two_lines(tmp_path)), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial"), *DEFAULT_OPTIONS,
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["status"] == "completed" and summary["request_counts"]["completed"] == 2
    _check_defaults(*_stored(summary["id"]))
    alias = _command("run").params
    assert any("--max-new-tokens" in p.opts and "--max-tokens" in p.opts for p in alias)


def test_submit_json_is_the_job_summary_with_every_default(tmp_path: Path, tiny_models: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.worker.services import RedisServer

    redis = RedisServer(tmp_path).start()
    try:
        monkeypatch.setenv("SPECBATCH_BROKER_URL", redis.url)
        result = CliRunner().invoke(cli, ["submit", str(_two_lines(tmp_path)), "--target",
                                          str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"),
                                          *DEFAULT_OPTIONS, "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["status"] == "queued"
        assert data["request_counts"]["total"] == 2 and data["request_counts"]["pending"] == 2
        assert data["tasks"] >= 1 and data["queue"]
        assert data["id"] == data["job_id"]
        _check_defaults(*_stored(data["id"]))
        assert redis.client().llen(data["queue"]) == data["tasks"]   # the tasks are on the pair's queue
    finally:
        redis.stop()


def test_the_entry_point_freezes_what_is_left_out_of_the_exits_collections(monkeypatch) -> None:
    """The interpreter's last garbage collections walked a loaded model's objects: 0.8 s between
    `specbatch run`'s summary and its exit on a 2-core host, 0.2 s with them frozen. The entry
    point registers ``gc.freeze`` at exit."""
    import atexit
    import gc

    from specbatch.cli import main as entry

    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(sys, "argv", ["specbatch", "--version"])
    with pytest.raises(SystemExit):
        entry.main()
    assert registered == [entry._freeze_at_exit]
    before = gc.get_freeze_count()
    try:
        entry._freeze_at_exit()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_a_command_leaves_no_sqlite_wal_behind_at_exit(tmp_path: Path) -> None:
    """The frozen exit (above) never closed the pooled database connections: every command left
    the -wal and -shm files, the newest jobs only in the -wal, not in the file `db url` names (a
    copy of it lacked them). Closed before the freeze, SQLite checkpoints and removes them."""
    path = tmp_path / "x.db"
    env = {**os.environ, "SPECBATCH_DATABASE_URL": f"sqlite:///{path}", "OMP_NUM_THREADS": "1"}
    for args in (["db", "upgrade"], ["jobs"]):
        done = subprocess.run([sys.executable, "-c", "from specbatch.cli.main import main; main()", *args],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"], (args, done.stderr)


def jobs_with(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> Any:
    """`specbatch jobs` with one setting's variable set: where a bad setting stops a command."""
    from specbatch.config import get_settings

    monkeypatch.setenv(var, value)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli, ["jobs"])
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize(("var", "value", "why"), [
    ("SPECBATCH_DEVICE", "tpu", "use cpu, cuda, cuda:N or mps"),
    ("SPECBATCH_DEVICE", "cuda:x", "use cpu, cuda, cuda:N or mps"),
    ("SPECBATCH_DTYPE", "bogus", "Input should be 'float32', 'fp32', 'bfloat16', 'bf16', 'float16' or 'fp16'"),
    ("SPECBATCH_DTYPE", "float64", "Input should be 'float32'")])
def test_a_bad_device_or_dtype_setting_stops_every_command_naming_its_variable(monkeypatch, var, value, why):
    """SPECBATCH_DTYPE=bogus let `specbatch jobs` exit 0 and `generate` fail after 'loading ...'
    with "unknown dtype" naming no variable (qa55); now it is a settings error like the others."""
    result = jobs_with(monkeypatch, var, value)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"Error: {var}={value!r}: ") and why in result.stderr, result.stderr


def test_the_dtype_setting_takes_the_names_the_loader_maps():
    from typing import get_args

    from specbatch.config import Settings
    from specbatch.engine.loading import DTYPES

    assert set(get_args(Settings.model_fields["dtype"].annotation)) == set(DTYPES)


@pytest.mark.parametrize("value", [",,", " , ", " "])
def test_api_keys_set_to_no_key_is_refused_not_read_as_no_authentication(monkeypatch, value):
    """qa55: SPECBATCH_API_KEYS=',,' (a broken secret template) started `serve` with 0 keys, no
    authentication. Unset or empty still means no keys."""
    result = jobs_with(monkeypatch, "SPECBATCH_API_KEYS", value)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"Error: SPECBATCH_API_KEYS={value!r}: set, but names no key"), result.stderr
