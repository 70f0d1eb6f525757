"""How this process spends its CPU cores: torch threads and decode lanes, set once, before the
first forward.

On a shared CPU more torch threads than free cores make every forward slower and noisier
(measured with the tiny models on a busy 2-core machine: 2 threads were about 6x slower than 1),
so the default is the cores this process may use divided among the worker processes started
together on the machine (``SPECBATCH_LOCAL_WORKERS``), in one decode loop. ``OMP_NUM_THREADS``,
where set, caps that default (each lane's, each forked process's): a job scheduler or a shell
profile that sets it means "no more than this many here", and the default already divides the
cores among workers, lanes and processes, so taking it as a count would oversubscribe them
(``OMP_NUM_THREADS=8`` with 4 local workers on 8 cores: 32 threads). ``--threads`` /
``SPECBATCH_THREADS`` fix the count instead.

``lanes`` (``SPECBATCH_LANES``, ``--lanes``) splits them among several decode loops over the same
models instead (engine/lanes.py), each with its share of torch threads: on a machine whose other
tenants keep a core busy, two lanes of one thread decoded the default job 2x as fast as one loop of
two threads, whose every operator waits for the thread that is not running; on a quiet machine
0.8-1.1x (the lanes take turns on the GIL for their Python). docs/DESIGN.md, "Decode lanes".

``processes`` (``specbatch run --processes``) divides them among processes forked after the load
(worker/forked.py). The loading process then runs one thread until it forks: a process forked
after GNU OpenMP (PyTorch's) ran a parallel region of more threads hangs in its own first one
(measured: a child of a parent that multiplied on 2 threads never finished a 512x512 product on 2;
on 1 it did), so each child takes its share only where its parent never ran more than one.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

logger = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What ``configure_threads`` set for this process."""

    threads: int      # torch threads this process decodes on (1 while it loads to fork)
    lanes: int
    forked: int       # threads of each process it forks to decode
    default: bool     # the threads are the default (the user gave none): the governor may lower them
    cap: int = 0      # OMP_NUM_THREADS's cap on the default (0: none), as read once by configure_threads


_SET: list[Plan] = []     # once set


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


def omp_threads(value: str) -> int:
    """An ``OMP_NUM_THREADS`` value as OpenMP reads it (its first level); 0 where it is empty or
    not a positive integer (OpenMP ignores such a value too)."""
    first = value.split(",")[0].strip()
    # (ASCII digits only: "²".isdigit() is True and int("²") raises)
    return int(first) if first.isascii() and first.isdigit() and int(first) > 0 else 0


def configure_threads(threads: int | None, local_workers: int = 1, lanes: int | None = None,
                      processes: int = 1) -> int:
    """Set torch's intra-op threads and the lanes once per process (None or 0: the default,
    capped by ``OMP_NUM_THREADS`` where set); later calls return the thread count already set.
    ``processes`` > 1: this process loads on one thread and each process it forks takes
    ``threads`` (default: its share of the cores)."""
    if _SET:
        return _SET[0].threads
    import torch

    n, lanes = plan(threads, lanes, local_workers * max(1, processes))
    why, cap = "given", 0
    if not threads:
        why = f"{usable_cores()} usable cores / {local_workers} local worker(s)" + \
            (f" / {lanes} lanes" if lanes > 1 else "") + (f" / {processes} processes" if processes > 1 else "")
        # a cap, never more: the default is at most the usable cores (a profile's 16 under
        # `taskset -c 0` is 1; torch.set_num_threads(100000) aborts in libgomp's thread creation).
        # Still the default below it: the governor may lower it while other processes hold cores
        # (read here only: the plan keeps the cap for decode_here)
        if cap := omp_threads(raw := os.environ.get("OMP_NUM_THREADS", "")):
            n = min(n, cap)
            why += f", at most OMP_NUM_THREADS={cap}"
        elif raw.strip():
            why += f" (OMP_NUM_THREADS={raw!r} is no positive integer: ignored)"
    own = 1 if processes > 1 else n
    torch.set_num_threads(own)
    _SET.append(Plan(own, lanes, n, not threads, cap))
    # (a worker's log says it at INFO; `run` with --debug): qa50w could tell only from /proc
    logger.info("torch threads: %d%s (%s)", n, " in each lane" if lanes > 1 else
                " in each forked process" if processes > 1 else "", why)
    return own


def forked_threads() -> int:
    """Torch threads for a process forked from this one to decode: its planned share where this
    process never ran more than one thread, else one (the module docstring says why)."""
    import torch

    if _SET and _SET[0].threads == 1 and torch.get_num_threads() == 1:
        return _SET[0].forked
    return 1


def decode_on(n: int) -> None:
    """This process decodes on ``n`` threads from now on: a forked child its share, or the
    parent that decodes after all (``decode_here``); what ``adaptable_threads`` governs."""
    import torch

    torch.set_num_threads(n)
    if _SET:
        _SET[0] = _SET[0]._replace(threads=n)


def decode_here(processes: int) -> None:
    """This process decodes after all, not the ``processes`` it planned to fork: it takes their
    threads, up to ``OMP_NUM_THREADS`` where that capped the default (a cap on each process, and
    this is one)."""
    if _SET and processes > 1:
        n = min(usable_cores(), _SET[0].forked * processes)
        decode_on(min(n, _SET[0].cap) if _SET[0].cap else n)


def adaptable_threads() -> int:
    """Torch threads a decode loop may lower while other processes hold the cores
    (engine/contention.py): those this process decodes on, where they are the default (the user
    set none) and one loop runs them; 0 where they are fixed."""
    return _one_loop_threads(default=True)


def fixed_threads() -> int:
    """Torch threads the user fixed (``--threads``, ``SPECBATCH_THREADS``) for one decode loop,
    where more than one (a run on them is told when other processes held the cores:
    ``contention.watching``); 0 otherwise."""
    return _one_loop_threads(default=False)


def _one_loop_threads(default: bool) -> int:
    """The threads one decode loop of this process runs on, where more than one and ``default``
    says whether the user left them to specbatch; else 0."""
    if not _SET or _SET[0].default != default or _SET[0].lanes > 1:
        return 0
    return _SET[0].threads if _SET[0].threads > 1 else 0


def configured_lanes() -> int:
    """The lanes ``configure_threads`` set; 1 where it was not called (a library caller that set
    its own threads)."""
    return _SET[0].lanes if _SET else 1
