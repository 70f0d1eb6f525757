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
    return True
