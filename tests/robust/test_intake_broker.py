"""Text no database can hold, the file before the broker, a broker that never answers (#16 items 5, 6, 11)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings

BAD_LINES = (
    '{"prompt": "x\\ud800y"}\n'                                          # a lone surrogate escape
    '{"prompt": "a\\u0000b"}\n'                                          # NUL
    '{"messages": [{"role": "user", "content": "\\udfff"}]}\n'
    '{"prompt": "fine \\ud83d\\ude00"}\n'                                # a proper pair: fine
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_count(url: str) -> int:
    from specbatch.db import session_factory
    from specbatch.db.models import Job

    with session_factory(url).begin() as s:
        return s.query(Job).count()


@pytest.mark.parametrize("command", ["submit", "run"])
def test_bad_text_is_file_line_error_on_both_databases(tmp_path: Path, db_url: str, command: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same FILE:LINE errors on SQLite and PostgreSQL, nothing written; `submit` says so even
    with the broker down, because the file is checked first."""
    path = tmp_path / "bad.jsonl"
    path.write_text(BAD_LINES)
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", db_url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", f"redis://127.0.0.1:{_closed_port()}/0")
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, [command, str(path), "--target", "org/unused"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1
    out = result.output
    assert f"{path}:1: prompt: contains a lone surrogate \\ud800" in out
    assert f"{path}:2: prompt: contains a NUL character" in out
    assert f"{path}:3: messages[0].content: contains a lone surrogate \\udfff" in out
    assert f"{path}:4" not in out and "broker" not in out and "Traceback" not in out
    assert _job_count(db_url) == 0


def test_submit_good_file_broker_down_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    path = tmp_path / "ok.jsonl"
    path.write_text('{"prompt": "fine"}\n')
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", f"redis://127.0.0.1:{_closed_port()}/0")
    result = CliRunner().invoke(cli, ["submit", str(path), "--target", "org/unused"])
    assert result.exit_code == 1 and "cannot reach the broker" in result.output
    assert not (tmp_path / "db.sqlite").exists() or _job_count(url) == 0


@pytest.fixture
def silent_broker() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for c in held:
        c.close()
    server.close()


def test_submit_against_a_broker_that_never_answers_fails_with_a_clear_error(tmp_path: Path,
                                                                             silent_broker: int) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text('{"prompt": "fine"}\n')
    env = {**os.environ, "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}",
           "SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{silent_broker}/0", "SPECBATCH_BROKER_TIMEOUT": "2"}
    exe = str(Path(sys.executable).parent / "specbatch")
    # bounded: without read timeouts this call never returns (the subprocess timeout fails the test)
    proc = subprocess.run([exe, "submit", str(path), "--target", "org/unused"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach the broker" in proc.stderr and "Timeout" in proc.stderr
    assert "Traceback" not in proc.stderr
