"""No password reaches a person: every command, with a password in both URLs (#16 item 1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.redact import RedactingFilter, mask

SECRET = "S3CRETPW"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mask() -> None:
    assert mask(f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:5432/DB") == \
        "postgresql+psycopg://postgres:***@127.0.0.1:5432/DB"
    assert mask(f"error at 'redis://:{SECRET}@h:6499/0' (refused)") == "error at 'redis://:***@h:6499/0' (refused)"
    assert mask("sqlite:////tmp/a:b@c/db.sqlite") == "sqlite:////tmp/a:b@c/db.sqlite"   # a path, no credentials
    assert mask("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_log_filter_masks_message_and_exception() -> None:
    import logging

    try:
        raise ConnectionError(f"redis://:{SECRET}@h/0 refused")
    except ConnectionError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "broker %s down", (f"redis://u:{SECRET}@h",),
                                   sys.exc_info())
    RedactingFilter().filter(record)
    assert SECRET not in logging.Formatter().format(record)


@pytest.mark.integration
def test_every_command_masks_both_urls(tmp_path: Path, pg_database: str, tiny_models: Path) -> None:
    db_url = pg_database.replace("postgres@", f"postgres:{SECRET}@")  # trust auth: any password works
    env = {"SPECBATCH_DATABASE_URL": db_url,
           "SPECBATCH_BROKER_URL": f"redis://:{SECRET}@127.0.0.1:{_closed_port()}/0",
           "SPECBATCH_CHUNK_SIZE": "2"}
    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"prompt": "a b c", "max_tokens": 3}\n{"prompt": "d e f", "max_tokens": 3}\n')
    target, draft = str(tiny_models / "llama"), str(tiny_models / "llama-partial")
    outputs: dict[str, str] = {}

    def invoke(*args: str) -> str:
        get_settings.cache_clear()
        result = CliRunner().invoke(cli, list(args), env=env)
        out = result.output + (repr(result.exception) if result.exception else "")
        outputs[" ".join(args[:2])] = out
        return out

    run_out = invoke("run", str(prompts), "--target", target, "--draft", draft)
    assert "results: postgresql+psycopg://postgres:***@" in run_out
    job_id = json.loads(invoke("jobs", "--json"))[0]["id"]
    from sqlalchemy import update

    from specbatch.db import session_factory
    from specbatch.db.models import Job, Request, RequestStatus

    with session_factory(db_url).begin() as s:   # one failed request, so `retry` talks to the broker
        s.execute(update(Request).where(Request.job_id == job_id).values(status=RequestStatus.failed,
                                                                          error="x"))
        s.execute(update(Job).where(Job.id == job_id).values(meta={}))  # a queued job: resume enqueues
    assert "cannot reach the broker at redis://:***@" in invoke("retry", job_id)
    assert "cannot reach the broker at redis://:***@" in invoke("submit", str(prompts), "--target", target)
    assert "cannot reach the broker" in invoke("resume", job_id)
    invoke("status", job_id)
    invoke("jobs")
    invoke("export", job_id, "-o", str(tmp_path / "out.jsonl"))
    invoke("cancel", job_id)
    invoke("db", "url")
    invoke("db", "upgrade")
    invoke("--debug", "submit", str(prompts), "--target", target)   # a masked stack trace
    # the real executable: logging as configured by the CLI, stderr and stdout together
    exe = str(Path(sys.executable).parent / "specbatch")
    proc = subprocess.run([exe, "--debug", "resume", job_id],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    outputs["subprocess --debug resume"] = proc.stdout + proc.stderr
    leaked = {cmd: out for cmd, out in outputs.items() if SECRET in out}
    assert not leaked, leaked
    assert len(outputs) >= 12


@pytest.mark.parametrize("url, shown", [
    (f"postgresql+psycopg://u@h:5432/db?sslmode=require&password={SECRET}&application_name=x",
     "postgresql+psycopg://u@h:5432/db?sslmode=require&password=***&application_name=x"),
    (f"postgresql://u@h/db?PassWord={SECRET};sslpassword={SECRET}", "postgresql://u@h/db?PassWord=***;sslpassword=***"),
    (f"redis://h:6379/0?password={SECRET}", "redis://h:6379/0?password=***"),
    (f"https://h/api?token={SECRET}", "https://h/api?token=***"),
    (f"postgresql://u:p%40ss%2Fw%3Ard%25{SECRET}%C3%BC@h/db", "postgresql://u:***@h/db"),
    (f"redis://:p@ss/w:rd{SECRET}@h:6379/0", "redis://:***@h:6379/0"),     # not even encoded
    (f"postgresql://u:{SECRET}@h/db?pass={SECRET}", "postgresql://u:***@h/db?pass=***"),
    ("postgresql://u@h/db?sslmode=require", "postgresql://u@h/db?sslmode=require"),
    ("redis://user@h/0", "redis://user@h/0"),                             # a user, no password
])
def test_mask_finds_secrets_wherever_a_url_keeps_them(url: str, shown: str) -> None:
    assert mask(url) == shown
    assert mask(f"cannot reach '{url}' (refused)") == f"cannot reach '{shown}' (refused)"


def test_masking_a_message_again_keeps_the_punctuation_after_a_masked_url(monkeypatch) -> None:
    """`cannot open the database ...?password=***: connection failed` lost its colon: the CLI's edge
    masks the message again, and the already-masked value took the colon after it for its own."""
    shown = mask(f"postgresql://u@h/db?password={SECRET}")
    for tail in (": refused", ", then", ") (x)", ". End"):
        assert mask(f"at {shown}{tail}") == f"at postgresql://u@h/db?password=***{tail}"
    assert mask(f"at postgresql://u@h/db?password={SECRET}:") == "at postgresql://u@h/db?password=***"  # raw: all of it
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"postgresql+psycopg://u@127.0.0.1:{_closed_port()}/x?password={SECRET}")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["jobs"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1 and SECRET not in result.output
    assert "/x?password=***: " in result.output, result.output


def test_a_worker_refusal_masks_the_database_url() -> None:
    from specbatch.db import session_factory
    from specbatch.worker.guard import refusal

    url = f"postgresql+psycopg://u@elsewhere/db?password={SECRET}"    # the worker's own URL
    with session_factory("sqlite://").begin() as s:
        reason = refusal(s, "job-x", [1], {"target": "t"}, url)
    assert reason and "not in this worker's database" in reason and SECRET not in reason


@pytest.mark.integration
def test_query_parameter_passwords_are_masked_by_every_command(pg_database: str, tmp_path: Path) -> None:
    """libpq takes ``?password=`` in a PostgreSQL URL, redis-py in a Redis URL (#32)."""
    env = {"SPECBATCH_DATABASE_URL": f"{pg_database}?password={SECRET}",
           "SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{_closed_port()}/0?password={SECRET}"}
    prompts = tmp_path / "one.jsonl"
    prompts.write_text('{"prompt": "a b c"}\n')
    outputs = {}
    for args in (["db", "upgrade"], ["db", "url"], ["jobs"], ["submit", str(prompts), "--target", "org/x"]):
        get_settings.cache_clear()
        result = CliRunner().invoke(cli, args, env=env)
        outputs[" ".join(args)] = result.output
    assert "?password=***" in outputs["db upgrade"], outputs
    assert "cannot reach the broker at redis://:***@127.0.0.1:" in outputs[f"submit {prompts} --target org/x"]
    leaked = {cmd: out for cmd, out in outputs.items() if SECRET in out}
    assert not leaked, leaked
