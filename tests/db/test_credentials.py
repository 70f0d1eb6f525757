"""A PostgreSQL URL whose password needs percent-encoding (``@/:%`` and non-ASCII) works for every
command: alembic's configparser must not read its ``%`` as interpolation. Against the real server
with a role of its own (created here, dropped after)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from click.testing import CliRunner

from specbatch import db
from specbatch.cli.main import cli
from specbatch.config import get_settings
from tests.db.databases import head_revision

PASSWORD = "p@ss/w:rd%x-ü"


@pytest.fixture
def role_url(pg_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database owned by a new role whose password is PASSWORD; the URL quotes it."""
    import psycopg
    from psycopg import sql

    name = f"specbatch_cred_{secrets.token_hex(4)}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(PASSWORD)))
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(name)))
    url = f"postgresql+psycopg://{name}:{quote(PASSWORD, safe='')}@127.0.0.1:5432/{name}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    try:
        yield url
    finally:
        db.forget_engines()
        get_settings.cache_clear()
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_a_percent_encoded_password_migrates_and_reads(role_url: str) -> None:
    assert "%" in role_url.split("@")[0]
    result = CliRunner().invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert db.current_revision(role_url) == head_revision()
    result = CliRunner().invoke(cli, ["jobs", "--json"])
    assert result.exit_code == 0, result.output
    for out in (CliRunner().invoke(cli, ["db", "upgrade"]).output, result.output):
        assert "p@ss" not in out and quote(PASSWORD, safe="") not in out
