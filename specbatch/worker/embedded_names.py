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


def release_dead_embedded(s: Any, job_id: str) -> list[int]:
    """End now the leases on the requests of ``job_id`` held by a ``specbatch run`` process of this
    host that no longer exists (killed: SIGKILL, the OOM killer); returns their ids. As for a
    killed worker (``store.expire_gone_leases``) the attempt of a row that began decoding stays
    charged: the row may be what killed it, and after ``max_attempts`` it fails instead of killing
    every resume. (An interrupted run gave its rows back itself, the attempt undone:
    ``embedded.wrap_up``.)"""
    from specbatch.jobs import store

    def dead_run(worker: str) -> bool:
        return worker.startswith(EMBEDDED_PREFIX) and gone_here(worker)

    return sorted(rid for rids in store.expire_gone_leases(s, job_id, dead_run).values() for rid in rids)
