"""The scratch directories of this machine's `specbatch worker`s (``workers_root / PID``): one per
worker process, holding its readiness file, its pool child's state file and ``worker.json`` (its
node name and queue). The worker writes them (``runner``); ``status`` on this machine reads them
when remote control does not answer in time (``monitor.starting_here``)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specbatch.config import Settings
from specbatch.worker.pids import alive

WORKER_FILE, STATE_FILE = "worker.json", "state"


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


@dataclass(frozen=True)
class LocalWorker:
    """What a worker's scratch directory says of it."""

    name: str               # its node name (``specbatch-PID@host``)
    queue: str | None
    state: str | None       # its pool child's state; None: not written yet


def write_worker(own: Path, name: str, queue: str) -> None:
    (own / WORKER_FILE).write_text(json.dumps({"name": name, "queue": queue}))


def read_worker(d: Path) -> LocalWorker | None:
    """None where there is nothing to read (the worker stopped meanwhile, or writes it now)."""
    try:
        worker = json.loads((d / WORKER_FILE).read_text())
        state = (d / STATE_FILE).read_text().strip() if (d / STATE_FILE).exists() else None
    except (OSError, ValueError):
        return None
    if not isinstance(worker, dict):
        return None
    queue = worker.get("queue")
    return LocalWorker(str(worker.get("name")), queue if isinstance(queue, str) else None, state)
