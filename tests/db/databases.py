"""Database fixtures shared by tests/db and tests/jobs: every store test runs on SQLite and PostgreSQL.

PostgreSQL is the real server on 127.0.0.1:5432 (trust auth). Each test session gets its own fresh
database (created here, dropped at the end), so parallel sessions of other engineers never collide;
tables are emptied between tests.
"""

from __future__ import annotations

import glob
import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from specbatch.db import forget_engines, get_engine

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def _pg_ready() -> bool:
    import psycopg

    try:
        with psycopg.connect(PG_ADMIN_DSN):
            return True
    except psycopg.OperationalError:
        return False


@pytest.fixture(scope="session")
def pg_server() -> str:
    """Make sure the local PostgreSQL answers, starting the cluster if it is down."""
    if not _pg_ready():
        versions = [os.path.basename(p) for p in glob.glob("/etc/postgresql/*")]
        for version in versions:
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"],
                           check=False, capture_output=True)
        deadline = time.monotonic() + 30
        while not _pg_ready():
            if time.monotonic() > deadline:
                pytest.fail(f"PostgreSQL at {PG_ADMIN_DSN!r} is down and could not be started "
                            f"(clusters: {versions})")
            time.sleep(0.5)
    return PG_ADMIN_DSN


@pytest.fixture(scope="session")
def pg_database(pg_server: str) -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, migrated; dropped afterwards."""
    import psycopg

    name = f"specbatch_test_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_URL.format(name=name)
    try:
        yield url
    finally:
        forget_engines()
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def empty_tables(url: str) -> None:
    with get_engine(url).begin() as conn:
        conn.execute(text("TRUNCATE api_batches, api_files, results, requests, jobs"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A migrated, empty database: a new SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        url = request.getfixturevalue("pg_database")
        empty_tables(url)
    get_engine(url)
    yield url
    forget_engines()


def head_revision() -> str:
    """The newest migration's revision id (the schema every new database is migrated to)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from specbatch.db import MIGRATIONS_DIR

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    (head,) = ScriptDirectory.from_config(cfg).get_heads()
    return head
