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
import selectors
import socket
import threading
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
    ``serve --workers N`` process listens with ``SO_REUSEPORT`` where the system has it; a
    request other than ``GET /healthz`` is a 404 or 405 and the connection is closed."""

    MAX_HEAD = 8192

    def __init__(self, sb: AppState, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        self.sb, self.loop = sb, loop
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self.sock.bind((host.strip("[]"), port))
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="specbatch-healthz", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def response(self, head: bytes) -> tuple[bytes, bool]:
        """(the HTTP answer to a request head, keep the connection)."""
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if path != b"/healthz":
            return _http(404, {"error": "only GET /healthz here"}), False
        if method != b"GET":
            return _http(405, {"error": "only GET /healthz here"}), False
        code, body = verdict(self._last())
        return _http(code, body), True

    def _last(self) -> dict[str, str]:
        probe, check = self.sb.probe, lambda: probe_round(self.sb)
        answer, due = probe.peek()
        if due:
            self.loop.call_soon_threadsafe(probe.start, check)
        if answer is not None:
            return answer
        try:     # no answer yet, or none for `stale` seconds: wait for the round on the loop
            return asyncio.run_coroutine_threadsafe(probe.get(check), self.loop).result(TIMEOUT + 1)
        except Exception:       # the loop did not run it in time (stuck, or stopping)
            return {"event_loop": f"no answer within {TIMEOUT + 1:.0f}s"}

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        pending: dict[socket.socket, bytes] = {}
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    if key.fileobj is self.sock:
                        try:
                            conn, _ = self.sock.accept()
                        except OSError:
                            continue
                        conn.settimeout(TIMEOUT)    # an answer is small: a send that blocks is a dead peer
                        sel.register(conn, selectors.EVENT_READ)
                        pending[conn] = b""
                        continue
                    conn = key.fileobj  # type: ignore[assignment]
                    if not self._read(conn, pending):
                        sel.unregister(conn)
                        del pending[conn]
                        conn.close()
        finally:
            for conn in pending:
                conn.close()
            sel.close()

    def _read(self, conn: socket.socket, pending: dict[socket.socket, bytes]) -> bool:
        """Answer the whole request heads read from ``conn``; False: close it."""
        try:
            data = conn.recv(65536)
            if not data:
                return False
            buf = pending[conn] + data
            while b"\r\n\r\n" in buf:
                head, _, buf = buf.partition(b"\r\n\r\n")
                out, keep = self.response(head)
                conn.sendall(out)
                if not keep:
                    return False
        except OSError:
            return False
        pending[conn] = buf
        return len(buf) <= self.MAX_HEAD


def _http(code: int, body: dict[str, str]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[code]
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data
