"""`specbatch run`: Ctrl-C, models that fail to load, exit statuses (#16 items 2, 3, 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from tests.tiny import without_chat_template

N = 40   # prompts: enough that Ctrl-C lands mid-job, few enough to resume quickly
EXE = str(Path(sys.executable).parent / "specbatch")
REPO = Path(__file__).resolve().parents[2]


def _prompts(path: Path, n: int, max_tokens: int, stagger: int = 0) -> Path:
    """n prompts; ``stagger``: line i asks for max_tokens + stagger * i tokens."""
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": f"word {i} and",
                                        "max_tokens": max_tokens + stagger * i}) + "\n" for i in range(n)))
    return path


def _db(url: str):
    from specbatch.db import session_factory

    return session_factory(url)


def _counts(url: str) -> tuple[int, dict[str, int]]:
    from sqlalchemy import func, select

    from specbatch.db.models import Request, Result

    with _db(url).begin() as s:
        results = s.scalar(select(func.count()).select_from(Result)) or 0
        by = dict(s.execute(select(Request.status, func.count()).group_by(Request.status)).all())
    return results, {getattr(k, "value", k): v for k, v in by.items()}


def _model_map_run(tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, list[str]]:
    """`run` of 4 prompts over a SQLite file (no broker), every other one sent by --model-map to a
    second pair: (the database URL, the prompt file, run's arguments)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                                           "body": {**({"model": "m2"} if i % 2 else {}),
                                                    "prompt": f"word {i} and", "max_tokens": 4}}) + "\n"
                               for i in range(4)))
    return url, prompts, ["run", str(prompts), "--target", str(models / "llama"), "--draft", "none",
                          "--model-map", f"m2={models / 'llama-partial'}", "--no-cache"]


def resume_interrupted(url: str, n: int) -> None:
    """The newest job reads as interrupted, none of its ``n`` requests held (the run handed them
    back), and `run --resume` completes them."""
    assert _counts(url)[1].get("running", 0) == 0
    get_settings.cache_clear()
    job = json.loads(CliRunner().invoke(cli, ["jobs", "--json"]).output)[0]
    assert job["status"] == "interrupted", job
    resumed = CliRunner().invoke(cli, ["run", "--resume", job["id"], "--json"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["request_counts"]["completed"] == n


def _start_run(tmp_path: Path, env: dict[str, str], models: Path, *extra: str,
               slow: bool = False) -> subprocess.Popen:
    # staggered lengths: rows finish one by one, so Ctrl-C after the first results lands mid-job
    # even where the whole batch decodes in a second (with one length, they all finished together)
    prompts = _prompts(tmp_path / "p.jsonl", N, 8, stagger=4)
    # ``slow``: every decode step 50 ms longer (tests/worker/slow_step_hook.py), so a Ctrl-C or a
    # `specbatch cancel` (a process's start) lands mid-job: a Zen 5 host decoded all 40 rows first
    cmd = [sys.executable, "-c", "import tests.worker.slow_step_hook; from specbatch.cli.main import cli; cli()"] \
        if slow else [EXE]
    return subprocess.Popen([*cmd, "run", str(prompts), "--target", str(models / "llama"),
                             "--draft", str(models / "llama-partial"), *extra],
                            env={**env, "PYTHONPATH": str(REPO)} if slow else env, cwd=REPO if slow else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_results(url: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if _counts(url)[0] >= n:
                return
        except Exception:   # the database is not created yet
            pass
        time.sleep(0.2)
    raise AssertionError("no results in time")


def _env(tmp_path: Path) -> tuple[dict[str, str], str]:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    return {**os.environ, "SPECBATCH_DATABASE_URL": url, "OMP_NUM_THREADS": "1",
            "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"}, url


@pytest.mark.slow     # ~1-2 min on 2 busy cores; .ci/run runs it (nothing else interrupts a run)
def test_ctrl_c_stops_keeps_results_releases_claims_and_resume_finishes(tmp_path: Path, tiny_models: Path) -> None:
    env, url = _env(tmp_path)
    proc = _start_run(tmp_path, env, tiny_models, slow=True)
    _wait_results(url, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "--resume" in err
    results, by = _counts(url)
    assert results >= 3 and by.get("completed", 0) == results
    assert by.get("running", 0) == 0                      # claims released
    assert by.get("pending", 0) > 0 and results + by["pending"] == N
    from specbatch.db.models import Request

    with _db(url).begin() as s:                            # a released claim costs no attempt
        assert all(r.attempts == 0 for r in s.query(Request).filter_by(status="pending"))
    get_settings.cache_clear()
    listing = CliRunner().invoke(cli, ["jobs", "--json"], env={"SPECBATCH_DATABASE_URL": url})
    job = json.loads(listing.output)[0]
    assert job["status"] == "interrupted", job
    resumed = subprocess.run([EXE, "run", "--resume", job["id"][:6], "--json"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["status"] == "completed"
    results, by = _counts(url)
    assert results == N and by == {"completed": N}
    again = subprocess.run([EXE, "run", "--resume", job["id"]], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"job {job['id']}: nothing left to run (completed)" in again.stderr


@pytest.mark.slow     # as above
def test_second_ctrl_c_exits_at_once_and_resume_without_broker_finishes(tmp_path: Path,
                                                                         tiny_models: Path) -> None:
    env, url = _env(tmp_path)
    proc = _start_run(tmp_path, env, tiny_models, "--batch-size", "4", slow=True)
    _wait_results(url, 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    get_settings.cache_clear()
    job_id = json.loads(CliRunner().invoke(cli, ["jobs", "--json"],
                                           env={"SPECBATCH_DATABASE_URL": url}).output)[0]["id"]
    # `resume` of a `run` job needs no broker (there is none) and takes back the dead run's leases
    resumed = subprocess.run([EXE, "resume", job_id], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    results, by = _counts(url)
    assert results == N and by == {"completed": N}


@pytest.mark.slow     # as above
def test_cancel_from_another_shell_stops_a_run_keeps_results_and_exits_1(tmp_path: Path, tiny_models: Path) -> None:
    env, url = _env(tmp_path)
    proc = _start_run(tmp_path, env, tiny_models, "--no-cache", slow=True)
    _wait_results(url, 3, proc)
    get_settings.cache_clear()
    job_id = json.loads(CliRunner().invoke(cli, ["jobs", "--json"],
                                           env={"SPECBATCH_DATABASE_URL": url}).output)[0]["id"]
    cancel = subprocess.run([EXE, "cancel", job_id], env=env, capture_output=True, text=True, timeout=120)
    assert cancel.returncode == 0, cancel.stderr
    out, err = proc.communicate(timeout=120)     # the run sees the cancel (worker.cancel.CancelWatch)
    assert proc.returncode == 1, (out, err)
    assert "Traceback" not in err and f"job {job_id} cancelled (`specbatch cancel`)" in err, err
    results, by = _counts(url)
    assert by.get("running", 0) == 0 and by.get("pending", 0) == 0, by
    assert by.get("completed", 0) == results and results + by.get("cancelled", 0) == N, by
    assert by.get("cancelled", 0) > 0, by                  # the run stopped: it did not decode the rest
    status = json.loads(CliRunner().invoke(cli, ["status", job_id, "--json"],
                                           env={"SPECBATCH_DATABASE_URL": url}).output)
    assert status["status"] == "cancelled", status
    assert status["request_counts"]["completed"] == results
    assert status["request_counts"]["cancelled"] == N - results


@pytest.mark.parametrize("case", ["unknown", "other-vocabulary", "cuda", "dtype"])
def test_model_that_cannot_load_leaves_no_job(tmp_path: Path, tiny_models: Path, case: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"unknown": ["--target", "no-such-model"],
            "other-vocabulary": ["--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "gpt2-bad")],
            "cuda": ["--target", str(tiny_models / "llama"), "--device", "cuda:7"],
            "dtype": ["--target", str(tiny_models / "llama"), "--dtype", "float8"]}[case]
    if case == "other-vocabulary":
        _other_vocabulary_model(tiny_models, tmp_path / "other")
        args[-1] = str(tmp_path / "other")
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path / "p.jsonl", 2, 4)), *args])
    assert result.exit_code == (2 if case == "dtype" else 1), result.output   # a dtype typo: usage
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.output.strip().splitlines()[-1].startswith("Error: ")
    assert not (tmp_path / "db.sqlite").exists() or _counts(url)[1] == {}


def _other_vocabulary_model(models: Path, out: Path) -> None:
    """The tiny llama with a tokenizer that maps ids differently (a draft of another family)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if out.exists():
        return
    shutil.copytree(models / "llama", out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([f"extra{i}" for i in range(40)])
    model = AutoModelForCausalLM.from_pretrained(out)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)


def test_exit_status_follows_the_job(tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    base = without_chat_template(tiny_models / "llama", tmp_path / "base")
    target = ["--target", str(base)]
    # chat messages to a model with no chat template fail on their own in the engine (a prompt
    # too long for the context or a token id past the vocabulary is refused at intake: no job)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ok = {"prompt": "a b", "max_tokens": 3}
    cases = {"failed": ([chat, chat], 1), "partial": ([ok, chat], 3), "ok": ([ok], 0)}
    for name, (lines, code) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        get_settings.cache_clear()
        result = CliRunner().invoke(cli, ["run", str(path), *target, "--json"])
        assert result.exit_code == code, (name, result.output)


def test_retry_of_a_run_job_reruns_the_failures_here_without_a_broker(tmp_path: Path, tiny_models: Path) -> None:
    """The exit-status table sends `run` users to `specbatch retry JOB`: it must work with no broker."""
    env, url = _env(tmp_path)          # the broker URL points at a closed port
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"custom_id": "ok", "prompt": "a b", "max_tokens": 3}) + "\n"
                    + json.dumps({"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3}) + "\n")
    # (a base model: the engine refuses the chat line, as test_exit_status_follows_the_job)
    base = without_chat_template(tiny_models / "llama", tmp_path / "base")
    made = subprocess.run([EXE, "run", str(path), "--target", str(base), "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 3, made.stderr
    job_id = json.loads(made.stdout)["id"]

    # nothing was fixed, so the request fails again, for the same reason, and the job is partial again
    retried = subprocess.run([EXE, "retry", job_id], env=env, capture_output=True, text=True, timeout=300)
    assert retried.returncode == 3, retried.stderr
    assert f"job {job_id}: 1 failed request pending again; running it here" in retried.stderr
    assert "broker" not in retried.stderr and "Traceback" not in retried.stderr
    get_settings.cache_clear()
    summary = json.loads(CliRunner().invoke(cli, ["status", job_id, "--json"],
                                            env={"SPECBATCH_DATABASE_URL": url}).output)
    assert summary["status"] == "completed_with_errors"
    (failure,) = summary["failures"]
    assert failure["custom_id"] == "chat" and "has no chat template" in failure["error"], failure
    assert _counts(url) == (1, {"completed": 1, "failed": 1})    # the completed one was not redone


@pytest.mark.parametrize("raised, status, said", [
    # not a request's fault (a bug, a device error): one line, no traceback
    (RuntimeError("device lost"), 1, "stopped: decoding failed (RuntimeError: device lost)"),
    # a second Ctrl-C (what stop_on_signals' handler raises on it), past ``except Exception``: the
    # run wrapped up as if it had finished, its claims left running on its dead name and the job
    # not interrupted (tidy52)
    (KeyboardInterrupt(), 130, "stopped at once"),
], ids=["engine-failure", "second-ctrl-c"])
def test_a_decode_stopped_mid_step_keeps_results_hands_back_the_claims_and_resume_finishes(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch, raised: BaseException, status: int,
        said: str) -> None:
    """The claims are handed back, the job is interrupted and `run --resume` finishes it."""
    from specbatch.engine.decoder import Decoder

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    real, steps = Decoder._step, [0]

    def failing(self):   # noqa: ANN001, ANN202
        steps[0] += 1
        if steps[0] == 30:
            raise raised
        return real(self)

    monkeypatch.setattr(Decoder, "_step", failing)
    args = ["run", str(_prompts(tmp_path / "p.jsonl", 12, 16)), "--target", str(tiny_models / "llama"),
            "--draft", str(tiny_models / "llama-partial"), "--batch-size", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == status, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if said in ln]
    assert "run --resume" in line, line
    results, by = _counts(url)
    assert 0 < results < 12 and by["completed"] == results
    monkeypatch.setattr(Decoder, "_step", real)
    resume_interrupted(url, 12)
    assert _counts(url) == (12, {"completed": 12})


def test_an_unexpected_error_in_any_command_is_one_line_unless_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    import specbatch.engine.loading as loading

    def broken(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        raise ValueError("a bug")

    monkeypatch.setattr(loading, "known_model_status", broken)
    plain = CliRunner().invoke(cli, ["models"])
    assert plain.exit_code == 1 and plain.stderr.strip() == (
        "Error: unexpected error (ValueError: a bug); --debug shows the stack trace; please report it")
    debug = CliRunner().invoke(cli, ["--debug", "models"])
    assert isinstance(debug.exception, ValueError)


def _listing_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Exception]:
    """A fresh SQLite database for the CLI whose job listing (``specbatch jobs``) raises the error
    the caller puts in the returned list: what the command says of a database error it meets."""
    import specbatch.jobs.store as store

    raised: list[Exception] = []

    def failing(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        raise raised[0]

    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    get_settings.cache_clear()
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    monkeypatch.setattr(store, "list_jobs", failing)
    return raised


def test_a_database_lost_mid_command_is_one_line_not_a_bug_to_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database that stopped answering after the command opened it (a server restarted) said
    "unexpected error ... please report it", over psycopg's two lines (tidy52)."""
    from sqlalchemy.exc import OperationalError

    raised = _listing_raises(tmp_path, monkeypatch)
    # SQLAlchemy's mark of a connection found dead (psycopg's message goes on over two lines)
    raised[:] = [OperationalError("SELECT jobs", {}, Exception(
        "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally"),
        connection_invalidated=True)]
    result = CliRunner().invoke(cli, ["jobs"])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: the database stopped answering (server closed the connection unexpectedly "
                           "This probably means"), line
    assert "please report it" not in line and "run the command again" in line
    # psycopg's own error for a connection it could not make (no SQLSTATE): the pool's next connect
    import psycopg

    raised[:] = [OperationalError("SELECT jobs", {}, psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused'))]
    line = CliRunner().invoke(cli, ["jobs"]).stderr.strip()
    assert line.startswith("Error: the database stopped answering (connection failed"), line
    # not every OperationalError is a lost database: rerunning fixes no missing column (review52)
    import sqlite3

    raised[:] = [OperationalError("SELECT jobs", {}, sqlite3.OperationalError("no such column: jobs.source"))]
    line = CliRunner().invoke(cli, ["jobs"]).stderr.strip()
    assert line.startswith("Error: unexpected error (OperationalError: ") and "please report it" in line, line


def test_a_sqlite_lock_past_the_busy_timeout_is_one_line_to_run_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holding the SQLite file's write lock past the busy timeout ("database is
    locked") said "unexpected error ... please report it" (tidy53): it is no bug, and rerunning helps."""
    import sqlite3

    import specbatch.db as db

    path = tmp_path / "db.sqlite"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{path}")
    get_settings.cache_clear()
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    db.forget_engines()
    monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_MS", 50)    # the next engine waits 50 ms, not 60 s
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")     # the other process, mid-write
        result = CliRunner().invoke(cli, ["cancel", "3f9a2c"])
    finally:
        holder.close()
        db.forget_engines()
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: the database was busy: another process held its write lock "), line
    assert "please report it" not in line and "run the command again" in line, line


def _snapshot_conflict(path: Path):   # noqa: ANN202
    """SQLite's own SQLITE_BUSY_SNAPSHOT: a WAL reader whose snapshot another connection wrote past
    tries to write (no busy handler runs: waiting cannot help)."""
    import sqlite3

    a, b = sqlite3.connect(path, isolation_level=None), sqlite3.connect(path, isolation_level=None)
    try:
        a.execute("PRAGMA journal_mode = WAL")
        a.execute("CREATE TABLE t (x)")
        a.execute("BEGIN")
        a.execute("SELECT * FROM t").fetchall()
        b.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(sqlite3.OperationalError) as e:
            a.execute("INSERT INTO t VALUES (2)")
    finally:
        a.close()
        b.close()
    assert e.value.sqlite_errorcode == sqlite3.SQLITE_BUSY_SNAPSHOT, e.value.sqlite_errorname
    return e.value


def test_sqlites_other_busy_and_locked_codes_say_what_they_mean_not_a_60_s_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SQLITE_BUSY extended code read "another process held its write lock for over 60 s"
    (tidy54): a snapshot conflict fails at once (no timeout ran), a recovery is another process
    repairing the log after a crash. SQLITE_LOCKED (a conflict inside one connection) is no busy
    database: a bug to report. Each one line, no traceback."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    raised = _listing_raises(tmp_path, monkeypatch)

    def line_for(orig: Exception) -> str:
        raised[:] = [OperationalError("INSERT", {}, orig)]
        result = CliRunner().invoke(cli, ["jobs"])
        assert result.exit_code == 1 and "Traceback" not in result.stderr, result.output
        (line,) = result.stderr.strip().splitlines()
        return line

    snapshot = line_for(_snapshot_conflict(tmp_path / "other.sqlite"))
    assert snapshot.startswith("Error: the database changed under this command: another process wrote to it "
                               "after this command began reading"), snapshot
    assert "60 s" not in snapshot and "run the command again" in snapshot, snapshot
    recovery = sqlite3.OperationalError("database is locked")
    recovery.sqlite_errorcode, recovery.sqlite_errorname = 261, "SQLITE_BUSY_RECOVERY"   # (not made on demand)
    line = line_for(recovery)
    assert line.startswith("Error: the database was busy: another process was recovering its write-ahead log "
                           "after a crash for over 60 s"), line
    locked = sqlite3.OperationalError("database table is locked")
    locked.sqlite_errorcode, locked.sqlite_errorname = sqlite3.SQLITE_LOCKED, "SQLITE_LOCKED"
    line = line_for(locked)
    assert line.startswith("Error: unexpected error (OperationalError: ") and "please report it" in line, line
    assert "busy" not in line, line


def test_out_of_device_memory_is_told_what_lowers_the_budget_not_reported_as_a_bug(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU that ran out of memory (torch.OutOfMemoryError, CUDA's allocator) is no bug: the line
    says what lowers the memory budget, instead of "please report it"."""
    import torch

    import specbatch.engine.loading as loading

    def oom(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(loading, "known_model_status", oom)
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert line.startswith("Error: out of device memory: ") and "--max-memory" in line and "--batch-size" in line, line
    assert "CUDA out of memory. Tried to allocate 2.00 GiB." in line and "please report it" not in line, line


def test_out_of_device_memory_mid_run_says_what_to_lower_before_the_resume(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run --resume` with the same budget would run out of memory again: the stopped line says
    what lowers it."""
    import torch

    from specbatch.engine.decoder import Decoder

    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()

    def oom(self):   # noqa: ANN001, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(Decoder, "_step", oom)
    args = ["run", str(_prompts(tmp_path / "p.jsonl", 2, 8)), "--target", str(tiny_models / "llama"),
            "--draft", "none"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error: ")]
    assert "decoding failed (OutOfMemoryError: CUDA out of memory." in line and "run --resume" in line, line
    assert "out of device memory" in line and "--max-memory" in line and "--batch-size" in line, line


def test_ctrl_c_while_the_models_load_exits_130_and_makes_no_job(tmp_path: Path, tiny_models: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's exit status for an interrupted run, not click's "Aborted!" and 1 (procqa)."""
    import specbatch.worker.local as local

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)

    def interrupted(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "load_pair", interrupted)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path / "p.jsonl", 3, 4)),
                                      "--target", str(tiny_models / "llama")])
    assert result.exit_code == 130, result.output
    assert "interrupted while loading the models; no job was made" in result.stderr
    assert "Aborted" not in result.output
    get_settings.cache_clear()
    listing = json.loads(CliRunner().invoke(cli, ["jobs", "--json"]).stdout)
    assert listing == [] or "no database" in listing["error"]["message"], listing


def test_a_run_loading_its_next_model_map_pair_has_named_itself_in_its_job(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tidy52: a run SIGKILLed while it loads a next --model-map pair holds no rows, and status,
    export and the next `run FILE` took it for a run still going. It names itself in its job before
    any load (store.set_runner): were this process gone then, the job reads as killed."""
    import specbatch.worker.local as local
    from specbatch.jobs import store
    from specbatch.worker.embedded_names import embedded_worker_name
    from specbatch.worker.pids import gone_here

    url, prompts, args = _model_map_run(tmp_path, tiny_models, monkeypatch)
    real, seen = local.load_pair, []

    def load_pair(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        if seen or (tmp_path / "db.sqlite").exists():   # (the run's own pair loads before its job exists)
            with _db(url).begin() as s:
                me = embedded_worker_name()
                seen.append((store.stopped_runs(s, str(prompts.resolve()), lambda w: w == me),
                             store.stopped_runs(s, str(prompts.resolve()), gone_here)))
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "load_pair", load_pair)
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    job_id = json.loads(result.stdout)["id"]
    (gone, alive), = seen                                  # the second pair's load
    assert [(jid, how) for jid, _, how in gone] == [(job_id, "killed")], seen
    assert alive == []                                     # this process runs: nothing to name


def test_a_second_ctrl_c_while_a_next_model_map_pair_loads_marks_the_job_interrupted(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C lands where no decode runs (a next --model-map pair loading): it exits 130
    saying the job stopped, and the job reads as interrupted (README) as when it lands mid-step,
    not as a job still running with no one to run it (review52)."""
    import specbatch.worker.local as local

    url, _, args = _model_map_run(tmp_path, tiny_models, monkeypatch)
    real = local.load_pair

    def load_pair(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        if (tmp_path / "db.sqlite").exists():   # (the run's own pair loads before its job exists)
            raise KeyboardInterrupt   # what stop_on_signals' handler raises on the second signal
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "load_pair", load_pair)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    assert "stopped at once" in result.stderr and "Traceback" not in result.stderr
    assert _counts(url) == (2, {"completed": 2, "pending": 2})
    monkeypatch.setattr(local, "load_pair", real)
    resume_interrupted(url, 4)


def test_a_second_run_resume_while_another_run_holds_the_rows_does_not_pass_for_done(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `run --resume JOB` at once (qa51): the second found every row leased by the first,
    decoded nothing, printed a "running" summary and exited 0, the status of "every request
    completed". It decodes what it can, names the live holder of the rest, and exits 1."""
    import socket

    from specbatch.jobs import store
    from specbatch.jobs.intake import ParsedRequest

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    params = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    reqs = [ParsedRequest(i + 1, f"q{i}", "completion", f"word {i} and", None, params) for i in range(4)]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])   # the first run, alive
    try:
        holder = f"embedded@{socket.gethostname()}:{other.pid}"
        with _db(url).begin() as s:
            job_id = store.create_job(s, target=str(tiny_models / "llama"), drafts=[], params={},
                                      requests=reqs, queue="sb.q", metadata={"embedded": True}).id
            ids = store.resumable_request_ids(s, job_id)
            store.claim_requests(s, ids[:2], holder, 300, 3)
            store.set_runner(s, job_id, holder)
        result = CliRunner().invoke(cli, ["run", "--resume", job_id])
    finally:
        other.kill()
        other.wait()
    assert result.exit_code == 1, result.output
    assert (f"job {job_id} is not finished: 2 running requests are held by {holder} on a live lease; "
            f"`specbatch status {job_id} --watch` follows it") in result.stderr, result.stderr
    assert _counts(url) == (2, {"completed": 2, "running": 2})
    # the second run, ended, took its name back; the first still runs the job (review52: the
    # second stood for it, and once gone named the first as killed while it loaded its next pair)
    with _db(url).begin() as s:
        assert store.get_job(s, job_id).meta[store.RUNNER] == [holder]


def test_run_of_a_file_whose_earlier_run_stopped_names_that_job(tmp_path: Path, tiny_models: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`specbatch run FILE` again after Ctrl-C (or a kill) made a new job and said nothing of the
    old one, left `interrupted` for ever (qa51). It names it, before the models load; a finished
    job, another file's and a run still alive are not named."""
    import socket

    from specbatch.jobs import store
    from specbatch.jobs.intake import ParsedRequest

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    assert CliRunner().invoke(cli, ["db", "upgrade"]).exit_code == 0
    prompts = _prompts(tmp_path / "p.jsonl", 3, 4)
    params = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    reqs = [ParsedRequest(i + 1, f"q{i}", "completion", f"word {i} and", None, params) for i in range(3)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    jobs = {}
    try:
        with _db(url).begin() as s:
            for name, source in (("interrupted", prompts), ("killed", prompts), ("alive", prompts),
                                 ("other file", tmp_path / "other.jsonl")):
                jobs[name] = store.create_job(s, target=str(tiny_models / "llama"), drafts=[], params={}, requests=reqs,
                                              queue="sb.q", source=str(source.resolve()),
                                              metadata={"embedded": True}).id
            store.set_interrupted(s, jobs["interrupted"], True)
            store.set_interrupted(s, jobs["other file"], True)
            for name, pid in (("killed", dead.pid), ("alive", alive.pid)):
                ids = store.resumable_request_ids(s, jobs[name])
                store.claim_requests(s, ids[:1], f"embedded@{socket.gethostname()}:{pid}", 300, 3)
        result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                          "--draft", "none", "--no-cache"])
    finally:
        alive.kill()
        alive.wait()
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if "an earlier run of this file" in line]
    assert said == [f"specbatch: an earlier run of this file, job {jobs[how]}, was {how} with 3 requests left; "
                    f"`specbatch run --resume {jobs[how]}` finishes it (this run starts a new job)"
                    for how in ("interrupted", "killed")], result.stderr
    # the next run: the first's own job, which completed, is not named; the run that was alive
    # has exited since (killed above) and is
    again = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"), "--draft", "none",
                                     "--no-cache"])
    named = [line.split(", ")[1] for line in again.stderr.splitlines() if "an earlier run of this file" in line]
    assert named == [f"job {jobs[name]}" for name in ("interrupted", "killed", "alive")], again.stderr
