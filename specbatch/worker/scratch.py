"""The scratch directories of this machine's `specbatch worker`s (``workers_root / PID``): one per
worker process, holding its readiness file, its pool child's state file and ``worker.json`` (its
node name, queue, and ``source``: a digest of the broker and database it consumes from, so a
`status` on another broker or database never counts it). The worker writes them (``runner``); ``status`` on this machine reads them
when remote control does not answer in time (``monitor.starting_here``)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from specbatch.config import Settings
from specbatch.worker.pids import alive

WORKER_FILE, STATE_FILE = "worker.json", "state"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")    # urlsplit's hostname: lower case, no brackets
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "postgresql": 5432}    # a URL without a port means these


def workers_root(settings: Settings) -> Path:
    """Where each `specbatch worker` of this machine keeps its scratch directory (``PID/``)."""
    return Path(settings.ready_dir or tempfile.gettempdir()) / f"specbatch-{os.getuid()}" / "workers"


def scratch_dirs(settings: Settings) -> list[tuple[Path, bool]]:
    """Each worker's scratch directory, and whether its process still runs (a worker killed with
    SIGKILL cleaned nothing up)."""
    root = workers_root(settings)
    if not root.is_dir():
        return []
    return [(d, alive(int(d.name))) for d in sorted(root.iterdir()) if d.name.isdigit()]


def source(settings: Settings) -> str:
    """Which broker and database a worker consumes from, as a digest of their URLs with secrets
    masked first (``worker.json`` is a file in /tmp: nothing derived from a password goes there).
    A relative SQLite path is made absolute: the same URL in another directory is another file;
    and the loopback host names are one (``localhost``, ``127.0.0.1``, ``::1``), as are a URL
    without a port and one with the default port: a worker on ``redis://localhost:6379/0`` serves
    a ``submit`` on ``redis://127.0.0.1`` (``_as_one``)."""
    from specbatch.db import sqlite_path
    from specbatch.redact import mask_url

    database = settings.database_url
    path = sqlite_path(database)
    if path is not None:
        database = f"sqlite:///{path.resolve()}"
    text = f"{_as_one(mask_url(settings.broker_url))}\n{_as_one(mask_url(database))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _as_one(url: str) -> str:
    """``url`` written one way for each server it names: a loopback host as ``localhost``, the
    scheme's default port written out (``redis://h`` is ``redis://h:6379``), and Redis's default
    database (none given is 0, as kombu reads it); any other URL unchanged."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:      # a port that is no number, several hosts: not ours to rewrite
        return url
    if host is None:        # sqlite:///path
        return url
    scheme = parts.scheme.partition("+")[0]     # postgresql+psycopg: the server is postgresql's
    port = port if port is not None else DEFAULT_PORTS.get(scheme)
    host = "localhost" if host in LOOPBACK_HOSTS else f"[{host}]" if ":" in host else host
    path = "/0" if scheme in ("redis", "rediss") and parts.path in ("", "/") else parts.path
    userinfo, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}{'' if port is None else f':{port}'}",
                                     path=path))


@dataclass(frozen=True)
class LocalWorker:
    """What a worker's scratch directory says of it."""

    name: str               # its node name (``specbatch-PID@host``)
    queue: str | None
    state: str | None       # its pool child's state; None: not written yet
    source: str | None      # ``source(settings)`` of the worker; None: an older worker's file


def write_worker(own: Path, name: str, queue: str, settings: Settings) -> None:
    (own / WORKER_FILE).write_text(json.dumps({"name": name, "queue": queue, "source": source(settings)}))


def read_worker(d: Path) -> LocalWorker | None:
    """None where there is nothing to read (the worker stopped meanwhile, or writes it now)."""
    try:
        worker = json.loads((d / WORKER_FILE).read_text())
        state = (d / STATE_FILE).read_text().strip() if (d / STATE_FILE).exists() else None
    except (OSError, ValueError):
        return None
    if not isinstance(worker, dict):
        return None
    queue, where = worker.get("queue"), worker.get("source")
    return LocalWorker(str(worker.get("name")), queue if isinstance(queue, str) else None, state,
                       where if isinstance(where, str) else None)
