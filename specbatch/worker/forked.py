"""``specbatch run`` over several processes forked from the one that loaded the models.

One decode loop cannot use a CPU's cores well at this project's model sizes: its torch threads
split every operator, and an operator over a few rows is too small to split, so the second thread
mostly waits (measured on a 2-core host: two processes of one thread decoded the default job
1.2-1.3x as fast as one of two threads on a quiet machine; on a busy one, a loop of two threads
collapsed to a tenth). Decode lanes (engine/lanes.py) split the cores among loops on threads and
pay for the GIL; processes do not.

The models load once, in the parent. It forks ``processes`` children after the load: they share
its weights copy-on-write (no second load, no second copy), and each decodes a contiguous part of
the job's prefix-ordered requests (so shared prefixes and duplicates stay together) through
``run_embedded``, claiming its rows with its own lease, as any worker does. The parent decodes
nothing; it shows every child's results, forwards a stop to them and waits:

- Ctrl-C reaches the whole process group; the children ignore it and the parent tells each on a
  pipe it watches (a parent that dies stops them too), so each stops at its next step and gives its rows back (the job interrupted,
  as in one process). A second Ctrl-C ends them at once (SIGTERM); the parent then hands back
  what they held and marks the job interrupted, as one process does (where a third cuts that
  short, the leases belong to dead ``specbatch run`` processes of this host, which the next ``run
  --resume`` takes back at once).
- A child whose engine fails stops the others; the parent raises its error (one line).
- ``specbatch cancel`` is seen by each child's own ``CancelWatch``.

Forking is safe here because nothing else runs in the parent at the fork: the engine is idle, each
child's torch runs its own threads (the parent set its share before the first forward, so no
OpenMP team of more threads exists to be inherited), and the database engines are forgotten in the
child (``db.forget_engines``: a pooled connection must not be shared across processes).
docs/DESIGN.md, "Processes".
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Collection, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

from specbatch.config import Settings
from specbatch.errors import SpecBatchError
from specbatch.worker.interrupt import StopRequest
from specbatch.worker.transaction import transact

if TYPE_CHECKING:
    from specbatch.engine.contention import Tally
    from specbatch.engine.engine import Engine
    from specbatch.worker.chunk import ResultEvent

logger = logging.getLogger(__name__)

MIN_ROWS = 8          # a process with fewer rows than this decodes too small a batch to be worth one
POLL_SECONDS = 0.1    # how often the parent looks at its stop while it waits for results


def cannot_fork(device: str, compile_mode: str, lanes: int, database_url: str) -> str | None:
    """Why a run with these settings cannot decode in forked processes (None: it can), told
    before anything loads."""
    from specbatch.db import sqlite_path

    if "fork" not in multiprocessing.get_all_start_methods():
        return "this platform cannot fork"
    if str(device).split(":")[0] != "cpu":
        return "processes are for a CPU (CUDA's state does not survive a fork)"
    if compile_mode in ("on", "static"):
        return "a compiled forward runs in one process"
    if lanes > 1:
        return "decode lanes run in one process"
    if database_url.startswith("sqlite") and sqlite_path(database_url) is None:
        return "an in-memory database lives in one process"
    return None


def forkable(engine: Engine, database_url: str) -> str | None:
    """Why the loaded ``engine`` cannot be decoded by forked processes (None: it can)."""
    plan = engine.compile_plan
    if (plan is not None and plan.enabled) or engine.background is not None or engine.static_cache:
        return "a compiled forward or the static cache runs in one process"
    return cannot_fork(str(engine.target.device), "off", engine.lanes, database_url)


def split(ids: Sequence[int], budgets: Sequence[int], parts: int) -> list[list[int]]:
    """``ids`` (in order) cut into at most ``parts`` contiguous runs of about equal tokens to
    generate (``budgets``, one per id); a run is cut only after ``MIN_ROWS`` ids (the last may hold
    fewer), and there is one run where ``ids`` hold fewer than 2 x ``MIN_ROWS``."""
    parts = max(1, min(parts, len(ids) // MIN_ROWS))
    total = sum(budgets) or 1
    out: list[list[int]] = [[]]
    done = 0
    for i, b in zip(ids, budgets, strict=True):
        # a new run once this one holds its share (the last run takes whatever is left)
        if len(out) < parts and done >= total * len(out) / parts and len(out[-1]) >= MIN_ROWS:
            out.append([])
        out[-1].append(i)
        done += b
    return out


def _light(out: Any) -> Any:
    """A result's output as the parent's progress needs it: stats, not text, tokens or logprobs
    (the result itself is in the database)."""
    return dataclasses.replace(out, text="", token_ids=[], logprobs=None,
                               siblings=[_light(s) for s in out.siblings])


def run_forked(settings: Settings, job_id: str, engine: Engine, processes: int,
               on_progress: Callable[[ResultEvent], None] | None = None, *,
               batch_size: int | str | None = None, stop: StopRequest | None = None,
               only: Collection[int] | None = None) -> bool:
    """``run_embedded`` (same arguments, same result) over up to ``processes`` forked children."""
    from specbatch.db import session_factory
    from specbatch.engine.contention import by_slot
    from specbatch.engine.memory import default_budget
    from specbatch.engine.threads import decode_here, forked_threads
    from specbatch.jobs import store
    from specbatch.worker.embedded import ids_to_decode, run_embedded

    sf = session_factory(settings.database_url)
    ids = transact(sf, ids_to_decode, job_id, None if only is None else set(only))
    parts = split(ids, _budgets(sf, ids), processes)
    if len(parts) < 2:     # too few rows to share
        decode_here(processes)
        return run_embedded(settings, job_id, engine, on_progress, batch_size=batch_size, stop=stop,
                            only=ids)
    stop = stop or StopRequest()
    # the parent's share of memory, divided: each child measures only its own rows
    memory = engine.max_memory or default_budget(engine.target.device)
    threads = forked_threads()
    ctx = multiprocessing.get_context("fork")
    children: list[_Child] = []
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # else each child warns of the fork
    for stream in (sys.stdout, sys.stderr):     # a buffered line would be written again by a child
        stream.flush()
    try:
        for part in parts:
            results, send = ctx.Pipe(duplex=False)
            stops, told = ctx.Pipe(duplex=False)
            # the earlier children's pipes, which this child must not hold open (their ends)
            inherited = [c for child in children for c in (child.results, child.stop)]
            process = ctx.Process(target=_child, name="specbatch-decode", daemon=True,
                                  args=(send, stops, inherited, os.getpid(), settings, job_id, engine, part,
                                        memory // len(parts), batch_size, threads))
            # no signal between the fork and the child's own handlers (it would run ours there)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            send.close()
            stops.close()
            children.append(_Child(process, results, told))
        finished, error, tallies = _gather(children, stop, on_progress)
        # for the run's end line (engine.contention_line); an earlier route's forks on this engine
        # were the same processes' slots, not more of them
        engine.forked_contention = by_slot(engine.forked_contention, tallies)
    except BaseException:
        # a second Ctrl-C (KeyboardInterrupt) or our own failure: end them at once, then hand back
        # what they held and mark the job interrupted, as one process does (``run_embedded``)
        for child in children:
            if child.process.is_alive():
                child.process.terminate()
        for child in children:
            child.process.join()
        transact(sf, _hand_back, job_id, [child.process.pid for child in children])
        raise
    finally:
        for child in children:
            child.results.close()
            child.stop.close()
    transact(sf, store.refresh_job, job_id)
    if error is not None:
        raise SpecBatchError(f"job {job_id} stopped: decoding failed in one of its {len(parts)} processes "
                             f"({error}); finished results are saved and `specbatch run --resume {job_id}` "
                             "retries the rest")
    return finished


def _hand_back(s: Any, job_id: str, pids: list[int]) -> None:
    """The claims of the ended children ``pids`` back to pending and the job interrupted (cancelled
    rows where it is being cancelled): their ``run_embedded`` had no time to wrap up."""
    from specbatch.worker.embedded import wrap_up
    from specbatch.worker.embedded_names import embedded_worker_name

    for pid in pids:
        wrap_up(s, job_id, embedded_worker_name(pid), False)


def _budgets(sf: Any, ids: list[int]) -> list[int]:
    """Each id's tokens to generate (``store.token_budgets`` gives a job's in no order, without n)."""
    from sqlalchemy import select

    from specbatch.db.models import Request

    def read(s: Any) -> list[int]:
        rows = dict(s.execute(select(Request.id, Request.params).where(Request.id.in_(ids))).all())
        # a request's n samples are n rows: n x its tokens
        return [int((rows[i] or {}).get("max_new_tokens") or 1) * int((rows[i] or {}).get("n") or 1)
                for i in ids]
    return transact(sf, read)


@dataclasses.dataclass
class _Child:
    process: Any
    # from it: ("result", event), then ("done", (finished, its governor's Tally or None)) or ("error", ...)
    results: Connection
    stop: Connection        # to it: a word there stops it at its next step

    def tell_stop(self) -> None:
        try:
            self.stop.send(None)
        except OSError:     # it has ended
            pass


def _gather(children: list[_Child], stop: StopRequest, on_progress: Callable[[ResultEvent], None] | None
            ) -> tuple[bool, str | None, list[Tally]]:
    """Each child's results shown as they come, until all have ended; (finished, first error, the
    governors' tallies of those that had one)."""
    finished, error, stopped = True, None, False
    tallies: list[Tally] = []
    open_ = {child.results: child for child in children}
    while open_:
        if (stop() or error is not None) and not stopped:
            for child in children:
                child.tell_stop()
            stopped = True
        for ready in wait(list(open_), timeout=POLL_SECONDS):
            results = cast(Connection, ready)
            try:
                kind, value = results.recv()
            except EOFError:    # it ended without a word: killed (the OOM killer, SIGKILL)
                child = open_.pop(results)
                child.process.join()
                error = error or f"a decode process ended with status {child.process.exitcode}"
                finished = False
                continue
            if kind == "result":
                if on_progress is not None:
                    on_progress(cast("ResultEvent", value))
                continue
            open_.pop(results).process.join()
            if kind == "done":
                done, tally = value
                finished = finished and bool(done)
                if tally is not None:
                    tallies.append(tally)
            else:   # "error": the others stop at their next step
                message, trace = value
                logger.debug("decode process failed:\n%s", trace)
                error, finished = error or message, False
    return finished, error, tallies


def _child(send: Connection, stops: Connection, inherited: list[Connection], parent: int, settings: Settings,
           job_id: str, engine: Engine, part: list[int], memory: int, batch_size: int | str | None,
           threads: int) -> None:
    """A forked process: decode ``part`` of the job, tell the parent each result, then its end."""
    from specbatch.db import forget_engines
    from specbatch.engine.threads import decode_on
    from specbatch.worker.embedded import run_embedded

    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent's stop reaches us through ``stops``
    signal.signal(signal.SIGTERM, signal.SIG_DFL)    # its second Ctrl-C: at once
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for conn in inherited:
        conn.close()
    # the parent's progress bar may have replaced them with proxies whose lock another of its
    # threads held at the fork: this process writes (a log line) to the streams themselves
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    forget_engines(close=False)
    decode_on(threads)
    # its own share of memory, and its own governor of its own threads (the parent's counted its)
    engine.max_memory, engine.memory, engine.contention = memory, None, None
    stop = StopRequest()

    def watch() -> None:     # until the parent says stop, or is gone (killed: its pipes stay open here)
        while not stops.poll(POLL_SECONDS * 10) and os.getppid() == parent:
            pass
        stop.event.set()

    threading.Thread(target=watch, name="specbatch-stop", daemon=True).start()
    try:
        def on_result(event: ResultEvent) -> None:
            light = dataclasses.replace(event, output=None if event.output is None else _light(event.output))
            send.send(("result", light))

        finished = run_embedded(settings, job_id, engine, on_result, batch_size=batch_size, stop=stop,
                                only=part)
        tally = engine.contention.tally() if engine.contention is not None else None
        send.send(("done", (finished, tally)))
    except BaseException as e:      # noqa: BLE001 (the parent says it, as one line)
        send.send(("error", (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        send.close()
        # not multiprocessing's exit, which flushes (and may lock) what the parent's threads own
        os._exit(0)
