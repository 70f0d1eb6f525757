"""Torch threads that follow the cores the machine leaves this process, by measurement.

A decode loop of N torch threads splits every operator N ways and waits for all N. When another
process keeps a core busy, one of them is off its core at every operator and the others wait
for it: on a 2-core host with one ``while True: pass`` process beside it, the default job decoded
at 70-74 tok/s on 2 threads against 171-177 on 1 (``scripts/run_variants.py ... --busy``). On a
quiet machine 2 threads were 1.5x one, so the count cannot simply be lowered.

The sign is cheap to read: the process's CPU time over a step against its wall time x threads.
A "step" here is what the governor reads (``observe``): a decode step, or one forward of a
prefill (an admission is a few forwards of seconds each); the run's end line counts them as
"decode steps and prefill forwards".
Measured over the default job's 128 steps (2 threads): 0.96-1.03 per step on a quiet host (10th
to 90th percentile), 0.58-0.75 with the busy process beside it. So after ``WINDOW`` steps whose
median is under ``LOW``, the loop drops to the threads that were running (at least one); after
``hold`` steps there it tries all of them again for a window, and stays if they run on their
cores, or drops again and waits twice as long next time (up to ``MAX_HOLD``). A quiet machine
pays nothing (no trial ever runs); a busy one pays a window of the slow count every ``hold``
steps.

The first decode starts on one thread where a check's own forwards found the cores taken. The text
does not move: a thread count changes which core computes which part of a product, not a number,
where a check (``same_logits``, once per process, model and count, before the count is used)
finds the target's logits bitwise the same on it as on all of them; where they differ on one
thread nothing switches, and a count between that differs is skipped for one thread.
docs/DESIGN.md, "Threads that follow the machine".
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

WINDOW = 4          # steps a decision reads (decode steps and prefill forwards: ``observe``)
LOW = 0.85          # CPU time / (wall x threads) under which the threads are not all on cores
FIRST_HOLD = 32     # steps at fewer threads before all of them are tried again
MAX_HOLD = 512
STEPS = "decode steps and prefill forwards"   # what the steps above are, in a run's end line


@dataclass
class Contention:
    """The threads one process decodes on: ``full`` (configured) or fewer while contended."""

    full: int
    now: int = 0
    hold: int = FIRST_HOLD
    waited: int = 0                  # steps at fewer threads since the last drop
    retrying: bool = False           # all threads are back for a window after a hold
    recent: list[float] = field(default_factory=list)
    history: list[tuple[int, int]] = field(default_factory=list)   # (step, threads) at each change
    steps: int = 0
    fewer: int = 0                   # steps decoded on fewer than ``full`` threads
    set_threads: Any = None          # torch.set_num_threads (a test passes its own)
    # whether the target's logits on n threads are those on ``full`` (checked before n is used)
    agrees: Callable[[int], bool] = lambda n: True
    # threads the user fixed (--threads): read the sign, never change them (``watching``)
    watch_only: bool = False
    taken: int = 0                   # watch_only: steps in windows whose threads were not all on cores
    # the cores its threads may run on, where fewer than them (0: as many): threads the user fixed
    # past the cores (--threads 4 on 2) never read more than cores/threads, with no other process
    cores: int = 0

    def __post_init__(self) -> None:
        self.now = self.now or self.full
        if self.set_threads is None:
            import torch

            self.set_threads = torch.set_num_threads

    def observe(self, wall: float, cpu: float) -> None:
        """One step (a decode step, or a prefill's forward) took ``wall`` seconds and the process
        ``cpu`` seconds of CPU time."""
        self.steps += 1
        if self.now < self.full:
            self.fewer += 1
            self.waited += 1
            if self.waited >= self.hold:       # try them all again (judged as any window at full)
                self._set(self.full)
                self.recent.clear()
                self.retrying = True
            return
        if wall <= 0:
            return
        self.recent.append(cpu / (wall * min(self.now, self.cores or self.now)))
        if len(self.recent) < WINDOW:
            return
        use = statistics.median(self.recent)
        self.recent.clear()
        if self.watch_only:
            self.taken += WINDOW if use < LOW else 0
            return
        retried, self.retrying = self.retrying, False
        if use >= LOW:
            if retried:
                self.hold = FIRST_HOLD     # a full window on cores after a retry: contention over
            return
        self.hold = min(MAX_HOLD, 2 * self.hold) if retried else self.hold
        self.waited = 0
        n = max(1, min(self.full - 1, int(use * self.now)))
        self._set(n if n == 1 or self.agrees(n) else 1)

    def _set(self, n: int) -> None:
        if n != self.now:
            if n < self.full and not any(t < self.full for _, t in self.history):   # once: why it slowed
                logger.info("other processes hold this machine's cores: decoding on %d of %d torch threads, "
                            "trying all again now and then", n, self.full)
            self.now = n
            self.set_threads(n)
            self.history.append((self.steps, n))
            logger.debug("torch threads %d (step %d)", n, self.steps)

    def tally(self) -> Tally:
        return Tally(self.full, self.steps, self.fewer, tuple(sorted({t for _, t in self.history if t < self.full})),
                     self.taken)


def watching(threads: int) -> Contention:
    """A governor of threads the user fixed (``--threads``, ``SPECBATCH_THREADS``): it reads each
    step's sign as any governor does and changes nothing, so that a run slowed by other processes
    can say so at its end and what leaving the threads to specbatch would do (``describe``). Its
    sign is read against the cores this process may use where the threads are more (the default
    never is): 4 threads on 2 quiet cores read 0.5 and blamed other processes at every run."""
    from specbatch.engine import threads as plan

    return Contention(threads, watch_only=True, set_threads=lambda n: None, cores=plan.usable_cores())


@dataclass(frozen=True)
class Tally:
    """What one governor did over a decode, picklable: a forked decode process sends its own to
    the process that prints the run's end line (worker/forked.py)."""

    full: int
    steps: int
    fewer: int                       # steps on fewer than ``full`` threads
    used: tuple[int, ...]            # the counts below ``full`` it decoded on
    taken: int = 0                   # steps with cores taken, on threads the user fixed (``watching``)

    def __add__(self, other: Tally) -> Tally:
        return Tally(max(self.full, other.full), self.steps + other.steps, self.fewer + other.fewer,
                     tuple(sorted({*self.used, *other.used})), self.taken + other.taken)


def by_slot(*decodes: Sequence[Tally]) -> list[Tally]:
    """The tallies of several decodes with one engine (each a process's, or each of its forked
    processes'), added up slot by slot: one per process that decoded at a time. Routes of one pair
    fork their processes again with the same engine, and listing every fork's tallies said "in 3
    of its 4 decode processes" of a `--processes 2` run."""
    out: list[Tally] = []
    for tallies in decodes:
        out = [a + b for a, b in zip(out, tallies)] + list(out[len(tallies):]) + list(tallies[len(out):])
    return out


def describe(tallies: Sequence[Tally]) -> str | None:
    """One line for a run's end where the cores were taken for a share of its steps (over every
    decode process's, where several decoded the run); else None."""
    steps, fewer = sum(t.steps for t in tallies), sum(t.fewer for t in tallies)
    taken = sum(t.taken for t in tallies)
    if not steps or not (fewer or taken >= TOLD_TAKEN * steps):
        return None
    where = "" if len(tallies) == 1 else \
        f", in {sum(1 for t in tallies if t.fewer or t.taken)} of its {len(tallies)} decode processes"
    full = max(t.full for t in tallies)
    if not fewer:     # threads the user fixed: it waited for them (contention.watching)
        return (f"other processes held this machine's cores for {_share(taken / steps)} of {steps} {STEPS}{where}: "
                f"every operator waited for the {full} torch threads --threads fixed; left unset "
                "(--threads, SPECBATCH_THREADS), specbatch decodes on the cores it has (README 'Throughput')")
    used = sorted({n for t in tallies for n in t.used})
    on = str(used[0]) if len(used) == 1 else f"{used[0]}-{used[-1]}"
    return (f"other processes held this machine's cores: decoded on {on} of {full} "
            f"torch threads for {_share(fewer / steps)} of {steps} {STEPS}{where} "
            "(README 'Throughput': a busy machine; the text is the same either way)")


# the share of a run's steps with cores taken that a run on fixed threads is told of (a window or
# two of a quiet run's noise is not worth a line)
TOLD_TAKEN = 0.1


def _share(x: float) -> str:
    return "<1%" if x < 0.005 else f"{x:.0%}"


_SAME: dict[tuple[int, int, int], tuple[bool, float]] = {}   # (model id, threads, threads) -> _same


def governor(model: Any, full: int) -> Contention | None:
    """A governor of ``full`` threads for decoding ``model`` (a loaded target), or None where its
    logits differ on one thread (checked once per model and count; any other count is checked
    before it is first used). It starts on one thread where the check's own forwards found the
    cores taken: a decode's first prefill is its longest step."""
    agree, speedup = same_logits(model, full, 1)
    if not agree:
        logger.info("the target's logits differ on 1 thread and on %d: the threads stay %d", full, full)
        return None
    # the check's own forwards, timed on all threads and on one: all of them no faster than one
    # is what taken cores do (quiet, 2 threads were 1.74x one here; beside a busy process 0.31x).
    # Not the CPU-time sign the steps read: on a quiet host `specbatch run`'s check read 0.78-0.80
    # of it (0.99 alone), started every run on one thread and lost 20-25% of the default job
    start = full if speedup >= 1.0 else 1
    logger.debug("start-up check: %d threads %.2fx one: starting on %d", full, speedup, start)
    governed = Contention(full, agrees=lambda n: same_logits(model, full, n)[0])
    governed.set_threads(full)      # (a previous engine's governor may have left fewer)
    governed._set(start)
    return governed


def same_logits(model: Any, full: int, n: int) -> tuple[bool, float]:
    """(whether ``model`` computes the same logits bitwise on ``n`` threads as on ``full``: a
    prompt's forward at 1 and 6 rows and one step over its cache; how many times faster the
    ``full`` pass ran than the ``n`` one), once per model and pair of counts."""
    key = (id(model.model), full, n)
    if key not in _SAME:
        _SAME[key] = _same(model, full, n)
    return _SAME[key]


def _same(model: Any, full: int, n: int) -> tuple[bool, float]:
    import torch

    from specbatch.engine.cache import BatchCache

    before = torch.get_num_threads()
    vocab = model.vocab_size

    def logits(threads: int) -> tuple[list[torch.Tensor], float]:
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(0)
        out = []
        w0 = time.perf_counter()
        for rows in (1, 6):
            ids = torch.randint(0, vocab, (rows, 8), generator=g).tolist()
            cache = BatchCache(model, rows)
            out.append(cache.forward(ids, logits_to_keep=8))
            out.append(cache.forward([[r[0]] for r in ids], logits_to_keep=1))
        return out, time.perf_counter() - w0

    try:
        with torch.inference_mode():     # (the fewer first: the first pass pays what warms up)
            (few, t_few), (many, t_many) = logits(n), logits(full)
            return all(torch.equal(a, b) for a, b in zip(many, few, strict=True)), t_few / max(1e-9, t_many)
    finally:
        torch.set_num_threads(before)
