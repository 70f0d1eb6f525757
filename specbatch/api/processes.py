"""``specbatch serve --workers N``: N server processes, each accepting on a listening socket of its own.

uvicorn's supervisor hands every process one shared socket, and whichever process wakes first
accepts a whole burst of connections: under 200 kept-alive clients one process held 158 of them
and the other 44, so the busy one's queue set the tail (p99 about 3x p50, issue 32). Here the
parent binds N sockets to the port with ``SO_REUSEPORT`` and gives each process one; the kernel
spreads new connections over them by a hash of the address pair. A process that dies is replaced
on the same socket (connections that arrive meanwhile wait in its queue).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import sys
import threading
from typing import Any

logger = logging.getLogger("uvicorn.error")

STARTUP_FAILURE = 3     # uvicorn's exit status when the app or its lifespan fails to start


def can_share_port() -> bool:
    """Linux spreads connections over a port's SO_REUSEPORT sockets; BSD and macOS give them all
    to one socket, and Windows has no such option."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def reuseport_sockets(sock: socket.socket, n: int) -> list[socket.socket]:
    """``n`` listening sockets on ``sock``'s address, ``SO_REUSEPORT`` set; ``sock`` (bound by
    ``serve.bind`` without it, so that a busy port fails as one line) is closed first. The port
    is taken again at once; a port chosen by the system (``--port 0``) stays the one it chose."""
    family, address = sock.family, sock.getsockname()
    sock.close()
    out: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(address)
            s.listen(2048)          # uvicorn's default backlog
            s.set_inheritable(True)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


def _serve_one(config: Any, sock: socket.socket) -> None:
    """A process's body: uvicorn on ``sock`` (the config arrives pickled, its logging not set up)."""
    import uvicorn

    config.configure_logging()
    uvicorn.Server(config).run(sockets=[sock])


def supervise(config: Any, sockets: list[socket.socket]) -> int:
    """One spawned process per socket until SIGINT or SIGTERM (passed on as SIGTERM: uvicorn's
    graceful stop); a process that dies is replaced, unless it failed to start (the next one
    would fail the same way): then all stop and the status is 3."""
    spawn = multiprocessing.get_context("spawn")
    multiprocessing.allow_connection_pickling()
    stop = threading.Event()
    status = 0

    def start(sock: socket.socket) -> Any:
        p = spawn.Process(target=_serve_one, args=(config, sock), name="specbatch-api")
        p.start()
        return p

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs = [start(s) for s in sockets]
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            if p.is_alive():
                continue
            if p.exitcode == STARTUP_FAILURE:
                logger.error("server process %s failed to start; stopping", p.pid)
                status = STARTUP_FAILURE
                stop.set()
                break
            logger.warning("server process %s died (exit status %s); starting another", p.pid, p.exitcode)
            procs[i] = start(sockets[i])
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join()
    for s in sockets:
        s.close()
    return status
