"""Real services for worker tests: a redis-server on a free port, worker and Flower subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Poll ``predicate`` until truthy; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """``redis-server`` on a free port, no persistence; ``restart()`` keeps the port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.started = False     # once: a restart keeps the port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start it and wait until it answers. ``free_port`` frees the port it found before
        redis-server binds it, so another process may take it in between: then this one exits
        at once, and a server that answers there may be another test's. A first start takes
        another port then; a restart keeps its port, so it fails."""
        import redis

        for _ in range(5):
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis.from_url(self.url)
            proc = self.proc
            wait_for(lambda proc=proc, client=client: proc.poll() is not None or _serves(client, proc.pid), 10,
                     "redis-server to answer")
            if proc.poll() is None:
                self.started = True
                return self
            if self.started:
                raise AssertionError(f"redis-server could not bind its port {self.port} again")
            self.port = free_port()
        raise AssertionError("redis-server found no free port in 5 tries")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def client(self):  # noqa: ANN201
        import redis

        return redis.Redis.from_url(self.url)


def _serves(client, pid: int) -> bool:  # noqa: ANN001
    """Whether the redis-server of process ``pid`` answers there (not another one on the port)."""
    try:
        return int(client.info("server")["process_id"]) == pid
    except Exception:
        return False


class Proc:
    """A subprocess with its output in a log file (read it in assertion messages)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._fh.closed:
            self._fh.flush()
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def children(self) -> list[int]:
        """Pids of this process's direct children (a prefork worker's pool processes)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        return [int(x) for x in out.split()]

    def pool_children(self) -> list[int]:
        """The prefork pool processes (not billiard's semaphore tracker, also a child)."""
        pids = []
        for pid in self.children():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "spawn_main" in cmd or ("tracker import" not in cmd and "billiard" not in cmd):
                pids.append(pid)
        return pids

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown, then SIGKILL of the whole process group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        else:  # leftover pool children of a killed parent
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._fh.close()


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


def get_json(url: str, auth):  # noqa: ANN001, ANN201
    """A JSON body (``{}`` for another OK body), or None when the server is not there or refused."""
    try:
        r = requests.get(url, auth=auth, timeout=5)
        return r.json() if r.ok and r.headers.get("content-type", "").startswith("application/json") \
            else ({} if r.ok else None)
    except requests.RequestException:
        return None
