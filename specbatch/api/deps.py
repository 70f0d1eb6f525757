"""What routes share, given through ``Depends``: the app's settings, sessions and background
finalizer (FastAPI, "Bigger Applications": shared dependencies in their own module).

``create_app`` (api/app.py) builds one ``AppState`` per app; a keyed route takes it with its tenant as
``caller: auth.Keyed`` (one dependency), a public one as ``sb: State``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

from specbatch.api.consumers import QueueWatch
from specbatch.config import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Finalizer:
    """Writes finished batches' output files in the background, one batch at a time, each once
    per process (a GET never waits for an export; the batch shows ``finalizing`` meanwhile)."""

    def __init__(self, settings: Settings, factory: sessionmaker, reader: sessionmaker) -> None:
        self.settings, self.factory, self.reader = settings, factory, reader
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specbatch-finalize")
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def schedule(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self._pending:
                return
            self._pending.add(batch_id)
        self._pool.submit(self._run, batch_id)

    def _run(self, batch_id: str) -> None:
        from specbatch.jobs.batches import finalize

        try:
            finalize(self.settings, self.factory, self.reader, batch_id)
        except Exception:
            logger.exception("batch %s: writing the output files failed; the next read retries", batch_id)
        finally:
            with self._lock:
                self._pending.discard(batch_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Probe:
    """``/healthz``'s last answer: reused for ``fresh`` seconds; past that, a probe starts a round
    of checks (one at a time: probes arriving meanwhile share it) and answers at once with the
    last answer while it is younger than ``stale`` seconds, waiting for the round only when it is
    older (or there is none yet). Under load a round took 0.5-3 s (a broker connection made of
    dozens of socket calls, each waiting for the GIL behind the busy route threads); a probe that
    waited for it missed its 50 ms (issue 32)."""

    def __init__(self, fresh: float, stale: float) -> None:
        self.fresh, self.stale = fresh, stale
        # (answer, when): one attribute, so that another thread (``health.HealthPort``) reads a pair
        self.last: tuple[dict[str, str], float] | None = None
        self.running: asyncio.Future[dict[str, str]] | None = None

    @property
    def answer(self) -> dict[str, str] | None:
        return self.last[0] if self.last is not None else None

    def current(self, start: Callable[[], object]) -> dict[str, str] | None:
        """The last answer while younger than ``stale``, else None (the caller waits for the
        round); ``start()`` first when a round is due (older than ``fresh``, or none yet).
        Reads only, ``start`` aside: safe from any thread whose ``start`` is."""
        last = self.last
        age = float("inf") if last is None else time.monotonic() - last[1]
        if age >= self.fresh:
            start()
        return last[0] if last is not None and age < self.stale else None

    async def get(self, check: Callable[[], Awaitable[dict[str, str]]]) -> dict[str, str]:
        answer = self.current(lambda: self.start(check))
        if answer is not None:
            return answer
        return await asyncio.shield(self.start(check))     # a client gone away does not stop the round

    def start(self, check: Callable[[], Awaitable[dict[str, str]]]) -> asyncio.Future[dict[str, str]]:
        """The round in flight, started now if there is none (the app starts one as it starts
        serving, so that the first probe finds an answer)."""
        if self.running is None or self.running.done():
            self.running = asyncio.ensure_future(self._round(check))
        return self.running

    async def _round(self, check: Callable[[], Awaitable[dict[str, str]]]) -> dict[str, str]:
        answer = await check()
        self.last = (answer, time.monotonic())
        return answer


@dataclass
class AppState:
    settings: Settings
    factory: sessionmaker
    reader: sessionmaker    # one snapshot across statements (export, stats, metrics)
    finalizer: Finalizer
    # the routes' short reads: plain rows on a connection, no transaction, each statement its own
    # snapshot (db.read_engine)
    reads: Engine
    checks: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="specbatch-health"))
    probe: Probe = field(default_factory=lambda: Probe(fresh=1.0, stale=5.0))
    consumers: QueueWatch = field(init=False)

    def __post_init__(self) -> None:
        self.consumers = QueueWatch(self.settings)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` on a connection of ``reads``, run once more on a new connection where the
        pooled one was gone: a PostgreSQL restart within ``db.IDLE_PING_SECONDS`` of the
        connection's last use, so not pinged. A read changes nothing: running it twice is safe."""
        try:
            with self.reads.connect() as c:
                return fn(c)
        except DBAPIError as e:
            if not e.connection_invalidated:
                raise
            logger.info("a pooled database connection was gone (%s); reading again on a new one",
                        type(e.orig).__name__)
        with self.reads.connect() as c:
            return fn(c)


@dataclass(frozen=True, slots=True)
class Caller:
    """What a keyed route is given (``auth.Keyed``): the app's state and the key's tenant."""
    sb: AppState
    owner: str | None       # the tenant; None: an admin key, or no keys: sees every tenant


async def app_state(request: Request) -> AppState:
    # async: FastAPI runs a sync dependency in the thread pool, a hop per request for a lookup
    return request.app.state.sb  # type: ignore[no-any-return]


State = Annotated[AppState, Depends(app_state)]
"""A route's share of the app's state: ``def route(sb: State)`` (FastAPI, "Bigger Applications")."""
