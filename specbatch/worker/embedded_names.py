"""Who a `specbatch run` process is in the ``worker`` column, and releasing the rows of one that
died. Apart from ``embedded`` (which decodes, importing torch and transformers): `specbatch resume`
needs only this, and took 8-10 s longer importing the engine it never uses."""

from __future__ import annotations

import os
import socket
from typing import Any

from specbatch.worker.pids import gone_here

EMBEDDED_PREFIX = "embedded@"


def embedded_worker_name(pid: int | None = None) -> str:
    return f"{EMBEDDED_PREFIX}{socket.gethostname()}:{pid or os.getpid()}"


def run_in_its_process(meta: dict[str, Any] | None) -> bool:
    """Whether a job (its ``meta``) was made by ``specbatch run``: that process (or a later ``run
    --resume`` / ``resume``) decodes its rows, with no broker; a worker's sweeps never send them."""
    return bool((meta or {}).get("embedded"))


def release_dead_embedded(s: Any, job_id: str) -> list[int]:
    """Release the requests of ``job_id`` held by a ``specbatch run`` process of this host that
    no longer exists (killed, or exited on a second Ctrl-C); returns their ids."""
    from specbatch.jobs import store

    released: list[int] = []
    for worker in store.running_workers(s, job_id):
        if worker.startswith(EMBEDDED_PREFIX) and gone_here(worker):
            released += store.release_held_by(s, job_id, worker)
    return released
