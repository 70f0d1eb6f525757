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
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


def verdict(out: dict[str, str]) -> tuple[int, dict[str, str]]:
    """(status code, body) of an answer: 200 when every check is ok, else 503."""
    ok = all(v == "ok" for v in out.values())
    return (200 if ok else 503), {"status": "ok" if ok else "unavailable", **out}


async def answer(sb: AppState) -> JSONResponse:
    code, body = verdict(await sb.probe.get(lambda: probe_round(sb)))
    return JSONResponse(body, status_code=code)


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


class HealthPort:
    """``GET /healthz`` on a port of its own (``serve --health-port``), answered by a thread of its
    own from ``sb.probe``'s last answer: the same body as the API port's, never queued behind the
    event loop's requests. A round that is due is started on the loop (``call_soon_threadsafe``,
    not waited for); with no answer younger than ``Probe.stale`` the thread waits for one round,
    at most ``TIMEOUT`` + 1 s, then answers 503: a loop stuck that long is not healthy.

    Under load the API port's probe waits for the requests read before it (a loop iteration of
    tens of ms at 200 clients); this thread waits only for the GIL (docs/bench/api-load.md). Every
    ``serve --workers N`` process listens with ``SO_REUSEPORT``; a request other than ``GET
    /healthz`` is a 404 or 405. The standard library's HTTP server: a probe is one small GET."""

    def __init__(self, sb: AppState, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        self.sb, self.loop = sb, loop
        self.server = _ProbeServer((host.strip("[]"), port), _handler(self))
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="specbatch-healthz", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def last(self) -> dict[str, str]:
        """The checks' last answer (a round started if one is due), as ``/healthz`` gives it."""
        probe, check = self.sb.probe, lambda: probe_round(self.sb)
        answer = probe.current(lambda: self.loop.call_soon_threadsafe(probe.start, check))
        if answer is not None:
            return answer
        try:     # no answer yet, or none for `stale` seconds: wait for the round on the loop
            return asyncio.run_coroutine_threadsafe(probe.get(check), self.loop).result(TIMEOUT + 1)
        except Exception:       # the loop did not run it in time (stuck, or stopping)
            return {"event_loop": f"no answer within {TIMEOUT + 1:.0f}s"}


class _ProbeServer(ThreadingHTTPServer):
    allow_reuse_port = True     # each `serve --workers N` process listens on the port
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


def _handler(port: HealthPort) -> type[BaseHTTPRequestHandler]:
    class Probe(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"       # keep-alive, as a prober's client expects
        timeout = TIMEOUT                   # a peer that sends nothing is dropped
        # the head and the body are two writes: with Nagle's algorithm the body waited for the
        # client's delayed ACK (p50 45 ms against 4 ms on the API port, scripts/api_goal.sh)
        disable_nagle_algorithm = True

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            if self.path.split("?", 1)[0] != "/healthz":
                self._send(404, {"error": "only GET /healthz here"})
            else:
                self._send(*verdict(port.last()))

        def _refuse(self) -> None:
            self._send(405 if self.path.split("?", 1)[0] == "/healthz" else 404, {"error": "only GET /healthz here"})

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse  # noqa: N815

        def _send(self, code: int, body: dict[str, str]) -> None:
            data = json.dumps(body, separators=(",", ":")).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            """Probes are not logged (uvicorn's access log is off too)."""

    return Probe
