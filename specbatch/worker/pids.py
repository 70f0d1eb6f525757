"""Whether a process id on this machine still runs (stale claims and directories of dead workers)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, as another user's process
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process nobody has reaped yet (Linux): signal 0 still reaches it. A SIGKILLed
    worker's pool child is one where the machine's init does not reap orphans (containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def gone_here(worker: str, host: str | None = None) -> bool:
    """Whether the process that ``worker`` names (a lease holder: ``NODE@HOST:PID``, as tasks and
    ``specbatch run`` sign their claims) ran on this machine and has exited. A holder on another
    machine, or a name of another shape, is not known to be gone: False."""
    import socket

    rest, _, pid = worker.rpartition(":")
    there = rest.rpartition("@")[2]
    if not pid.isdigit() or not there or there != (host or socket.gethostname()):
        return False
    return not alive(int(pid))
