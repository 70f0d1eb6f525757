"""``GET /healthz``: the database and the broker, each answered within a bounded time. No key
needed (load balancers probe it); the answer names no URL or credential.

The route is ``async`` and never enters the routes' thread pool: under load that pool is full of
list/retrieve calls and a probe queued behind them took over a second (issue 32). The checks run
on their own small executor; probes arriving together share one round of checks, and an answer
is reused for a second (``deps.Probe``), so a burst of probes costs the database one ``SELECT 1``.
Past that second a probe starts the next round and answers with the last one (at most 5 s old:
a round ends within ``TIMEOUT``), so no probe waits for the checks once one round has ended.

``HealthFirst`` answers ``GET /healthz`` before the app's own middleware and routing (the key
check, the body guard, route matching and FastAPI's dependency solving: about 130 us of CPU a probe
through the app, 10-15 us here, measured in process); the route below gives the same answer where
the middleware is not in front (and documents ``/healthz`` in the schema). Under load a probe's
wait is the other requests' work queued on the loop ahead of it, which this does not shorten
(docs/bench/api-load.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.types import ASGIApp, Receive, Scope, Send

from specbatch.api.deps import AppState, State
from specbatch.worker.enqueue import check_broker

logger = logging.getLogger(__name__)

router = APIRouter(tags=["health"])
TIMEOUT = 3.0       # seconds per check; they run side by side


def _database(sb: AppState) -> None:
    with sb.reads.connect() as c:
        c.execute(text("SELECT 1"))


async def _check(sb: AppState, name: str, fn: Any, *args: Any) -> str:
    try:
        await asyncio.wait_for(asyncio.wrap_future(sb.checks.submit(fn, *args)), TIMEOUT)
        return "ok"
    except TimeoutError:
        return f"no answer within {TIMEOUT:.0f}s"
    except Exception as e:
        logger.warning("healthz: %s check failed (%s)", name, type(e).__name__)
        return f"unreachable ({type(e).__name__})"


async def probe_round(sb: AppState) -> dict[str, str]:
    database, broker = await asyncio.gather(_check(sb, "database", _database, sb),
                                            _check(sb, "broker", check_broker, sb.settings, TIMEOUT - 1))
    return {"database": database, "broker": broker}


async def answer(sb: AppState) -> JSONResponse:
    out = await sb.probe.get(lambda: probe_round(sb))
    ok = all(v == "ok" for v in out.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", **out}, status_code=200 if ok else 503)


@router.get("/healthz")
async def healthz(sb: State) -> JSONResponse:
    return await answer(sb)


class HealthFirst:
    """ASGI middleware, in front of every other of the app's: ``GET /healthz`` answered from
    ``sb.probe`` at once; anything else passes on untouched."""

    def __init__(self, app: ASGIApp, sb: AppState) -> None:
        self.app, self.sb = app, sb

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/healthz" and scope["method"] == "GET":
            await (await answer(self.sb))(scope, receive, send)
            return
        await self.app(scope, receive, send)
