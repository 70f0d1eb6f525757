"""How this process spends its CPU cores: torch threads and decode lanes, set once, before the
first forward.

On a shared CPU more torch threads than free cores make every forward slower and noisier
(measured with the tiny models on a busy 2-core machine: 2 threads were about 6x slower than 1),
so the default is the cores this process may use divided among the worker processes started
together on the machine (``SPECBATCH_LOCAL_WORKERS``), in one decode loop.

``lanes`` (``SPECBATCH_LANES``, ``--lanes``) splits them among several decode loops over the same
models instead (engine/lanes.py), each with its share of torch threads: on a machine whose other
tenants keep a core busy, two lanes of one thread decoded the default job 2x as fast as one loop of
two threads, whose every operator waits for the thread that is not running; on a quiet machine
0.8-1.1x (the lanes take turns on the GIL for their Python). docs/DESIGN.md, "Decode lanes".
"""

from __future__ import annotations

import os

_SET: list[tuple[int, int]] = []     # (torch threads, lanes), once set


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        return os.cpu_count() or 1


def default_threads(local_workers: int = 1) -> int:
    """This process's share of the cores."""
    return max(1, usable_cores() // max(1, local_workers))


def plan(threads: int | None, lanes: int | None = None, local_workers: int = 1) -> tuple[int, int]:
    """(torch threads a lane, lanes): ``threads`` each if given, else the process's share of the
    cores divided among the lanes (default one)."""
    lanes = max(1, lanes or 1)
    return threads or max(1, default_threads(local_workers) // lanes), lanes


def configure_threads(threads: int | None, local_workers: int = 1, lanes: int | None = None) -> int:
    """Set torch's intra-op threads and the lanes once per process (None or 0: the default);
    later calls return the thread count already set."""
    if _SET:
        return _SET[0][0]
    import torch

    n, lanes = plan(threads, lanes, local_workers)
    torch.set_num_threads(n)
    _SET.append((n, lanes))
    return n


def configured_lanes() -> int:
    """The lanes ``configure_threads`` set; 1 where it was not called (a library caller that set
    its own threads)."""
    return _SET[0][1] if _SET else 1
