"""The CPU thread count of this process: set once, before the first forward.

On a shared CPU more torch threads than free cores make every forward slower and noisier
(measured with the tiny models on a busy 2-core machine: 2 threads were about 6x slower than 1),
so the default is the cores this process may use divided among the worker processes started
together on the machine.
"""

from __future__ import annotations

import os

_SET: list[int] = []


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        return os.cpu_count() or 1


def default_threads(local_workers: int = 1) -> int:
    return max(1, usable_cores() // max(1, local_workers))


def configure_threads(threads: int | None, local_workers: int = 1) -> int:
    """Set torch's intra-op threads once per process (``threads`` None or 0: the default);
    later calls return the count already set."""
    if _SET:
        return _SET[0]
    import torch

    n = threads or default_threads(local_workers)
    torch.set_num_threads(n)
    _SET.append(n)
    return n
