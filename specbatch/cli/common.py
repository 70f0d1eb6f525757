"""Small helpers shared by the command modules (keep this file small; see docs/CONTRACTS.md)."""

from __future__ import annotations

import json
from typing import Any

import click
from sqlalchemy.orm import sessionmaker

from specbatch.config import Settings


def open_db(settings: Settings) -> sessionmaker:
    """The session factory for ``settings.database_url``; says on stderr when it creates a new SQLite file."""
    from specbatch.db import session_factory, sqlite_path

    path = sqlite_path(settings.database_url)
    is_new = path is not None and not path.exists()
    factory = session_factory(settings.database_url)
    if is_new:
        click.echo(f"specbatch: created a new database at {path} "
                   "(set SPECBATCH_DATABASE_URL to use another)", err=True)
    return factory


def echo_json(data: Any) -> None:
    """Machine output for ``--json``: one JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, default=str))


def warn(message: str) -> None:
    """A warning for people, on stderr (never mixed into --json output)."""
    click.secho(f"warning: {message}", err=True, fg="yellow")
