"""Load a running ``specbatch serve`` with concurrent list/retrieve clients (issue 32, item 7).

    specbatch serve --port 8765 --workers 2 &         # SQLite, or SPECBATCH_DATABASE_URL=postgresql://...
    python scripts/api_load.py --url http://127.0.0.1:8765 --clients 200 --seconds 30 --server-pid $!

It uploads one small batch file and creates ``--batches`` batches from it (a batch needs the
broker up; with none, only files are read; a later run reuses them), then runs ``--clients`` clients side by side, each
sending its next request as soon as the last one is answered (a closed loop: the worst case for
latency): list batches, retrieve a batch, list files, retrieve a file, in turn. Beside them one
probe asks ``/healthz`` every ``--health-every`` seconds (250 ms) from a process of its own, as a
load balancer would (``--health-from loop``: from the clients' event loop, whose own lag then
counts; ``--also-health-url``: a second probe, e.g. on ``serve --health-port``). It stops after
``--seconds`` or ``--requests`` requests, whichever comes first, and prints req/s, p50/p99
latency, /healthz p50/p95/p99/max and errors, the clients' loop lag, plus the load average (the
machine may be shared: read the figures next to it).

Loopback only: it refuses any other host (it is a load generator, not a tool to point at others).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

try:
    import httpx
except ImportError:          # this machine's venv carries the package under the name httpx2
    import httpx2 as httpx  # type: ignore[no-redef]

LINE = {"custom_id": "load-0", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}}


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)       # seconds, successful requests
    health: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    sent: int = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def loopback_only(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}   # (an IP address: a str)
    except OSError as e:
        sys.exit(f"cannot resolve {host!r}: {e}")
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        sys.exit(f"refusing to load {host!r}: this script only targets a loopback address (127.0.0.1, ::1)")


def _stat(pid: int) -> list[str] | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` and its children (``serve --workers N``), threads
    included (Linux /proc); None elsewhere."""
    fields = _stat(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    for entry in os.listdir("/proc"):
        child = _stat(int(entry)) if entry.isdigit() else None
        if child is not None and child[1] == str(pid):
            ticks += int(child[11]) + int(child[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def seed(client: httpx.AsyncClient, batches: int) -> tuple[str, list[str]]:
    """A file and ``batches`` batches to read: those of an earlier run when there are enough (creating
    a batch reads the model's header, seconds of the server's CPU that would blur the figures)."""
    r = await client.get("/v1/batches", params={"limit": 100})
    r.raise_for_status()
    earlier = [b for b in r.json()["data"] if b["input_file_id"]]
    if batches and len(earlier) >= batches:
        return earlier[0]["input_file_id"], [b["id"] for b in earlier[:batches]]
    body = (json.dumps(LINE) + "\n").encode()
    r = await client.post("/v1/files", files={"file": ("load.jsonl", body)}, data={"purpose": "batch"})
    r.raise_for_status()
    file_id = r.json()["id"]
    made: list[str] = []
    for _ in range(batches):
        r = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}, timeout=120)
        if r.status_code != 200:
            print(f"note: creating a batch answered {r.status_code} ({r.text[:120]}); reading files only",
                  file=sys.stderr)
            break
        made.append(r.json()["id"])
    return file_id, made


class Connection:
    """One kept-alive HTTP/1.1 connection that sends GETs and reads ``Content-Length`` answers: a
    fraction of httpx's CPU per request (httpx took 5.5 ms a request here, twice the server's own,
    and on a 2-core machine the load generator's CPU is taken from the server it measures)."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.head = f"Host: {parts.netloc}\r\n{extra}\r\n"
        self.timeout = timeout
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, path: str) -> int:
        """The status of ``GET path`` (the body is read and dropped); OSError or TimeoutError."""
        try:
            if sys.version_info < (3, 11):
                return await asyncio.wait_for(self._get(path), self.timeout)
            async with asyncio.timeout(self.timeout):   # no task of its own, unlike wait_for
                return await self._get(path)
        except BaseException:
            self.close()        # a half-read answer would desynchronise the next one
            raise

    async def _get(self, path: str) -> int:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        writer.write(f"GET {path} HTTP/1.1\r\n{self.head}".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
        if "content-length" not in fields:
            raise OSError("an answer without Content-Length")
        await reader.readexactly(int(fields["content-length"]))
        if fields.get("connection", "").lower() == "close":
            self.close()
        return int(status_line.split()[1])

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def client_loop(args: argparse.Namespace, headers: dict[str, str], paths: list[str], tally: Tally,
                      deadline: float, budget: list[int], offset: int) -> None:
    conn = Connection(args.url, headers, args.timeout)
    i = offset
    try:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            path = paths[i % len(paths)]
            i += 1
            t0 = time.perf_counter()
            try:
                status = await conn.get(path)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                tally.error(type(e).__name__)
                continue
            finally:
                tally.sent += 1
            if status == 200:
                tally.latencies.append(time.perf_counter() - t0)
            else:
                tally.error(f"HTTP {status}")
    finally:
        conn.close()


async def health_probe(url: str, every: float, tally: Tally, stop: asyncio.Event) -> None:
    """``/healthz`` every ``every`` seconds from the clients' own event loop (``--health-from loop``):
    a probe's time then includes the wait for this loop, busy with the clients' answers."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await probe.get("/healthz")
                if r.status_code == 200:
                    tally.health.append(time.perf_counter() - t0)
                else:
                    tally.error(f"/healthz HTTP {r.status_code}")
            except httpx.HTTPError as e:
                tally.error(f"/healthz {type(e).__name__}")
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass


def health_process(url: str, every: float, seconds: float, out: Any) -> None:
    """``/healthz`` every ``every`` seconds for ``seconds`` from a process of its own, on a kept-alive
    connection with blocking sockets (``--health-from process``, the default): as a load balancer
    probes, so that a probe's time is the server's, not the wait for the clients' busy loop. Sends
    ([seconds of each 200], {error: count}) on ``out``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = f"GET /healthz HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()
    times: list[float] = []
    errors: dict[str, int] = {}
    sock: socket.socket | None = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=30)
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("connection closed")
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next(int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length"))
            while len(body) < length:
                body += sock.recv(65536)
            status = int(lines[0].split()[1])
            if status == 200:
                times.append(time.perf_counter() - t0)
            else:
                errors[f"/healthz HTTP {status}"] = errors.get(f"/healthz HTTP {status}", 0) + 1
        except OSError as e:
            errors[f"/healthz {type(e).__name__}"] = errors.get(f"/healthz {type(e).__name__}", 0) + 1
            if sock is not None:
                sock.close()
            sock = None
        time.sleep(max(0.0, every - (time.perf_counter() - t0)))
    if sock is not None:
        sock.close()
    out.send((times, errors))


async def loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late the clients' own loop wakes a 10 ms sleep: how busy the load generator is."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - t0 - 0.01)


async def main(args: argparse.Namespace) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as client:
        file_id, batch_ids = await seed(client, args.batches)
        paths = ["/v1/files?limit=20", f"/v1/files/{file_id}"]
        if batch_ids:
            paths += ["/v1/batches?limit=20", *[f"/v1/batches/{b}" for b in batch_ids]]
        tally, stop = Tally(), asyncio.Event()
        load_before = os.getloadavg()
        cpu_before = cpu_seconds(args.server_pid) if args.server_pid else None
        own_before = time.process_time()
        health_url = args.health_url or args.url
        if args.health_from == "loop":
            probe = asyncio.create_task(health_probe(health_url, args.health_every, tally, stop))
        else:
            import multiprocessing

            spawn = multiprocessing.get_context("spawn")
            received, sender = spawn.Pipe(duplex=False)
            prober = spawn.Process(target=health_process, args=(health_url, args.health_every, args.seconds, sender))
            prober.start()
        if args.also_health_url:        # a second probe, side by side with the first (same run, same load)
            import multiprocessing

            spawn2 = multiprocessing.get_context("spawn")
            received2, sender2 = spawn2.Pipe(duplex=False)
            prober2 = spawn2.Process(target=health_process,
                                     args=(args.also_health_url, args.health_every, args.seconds, sender2))
            prober2.start()
        lags: list[float] = []
        lag = asyncio.create_task(loop_lag(lags, stop))
        t0 = time.monotonic()
        deadline, budget = t0 + args.seconds, [args.requests]
        await asyncio.gather(*(client_loop(args, headers, paths, tally, deadline, budget, n)
                               for n in range(args.clients)))
        elapsed = time.monotonic() - t0
        own = time.process_time() - own_before
        stop.set()
        await lag
        if args.health_from == "loop":
            await probe
        else:
            times, health_errors = await asyncio.to_thread(received.recv)
            prober.join()
            tally.health += times
            for k, v in health_errors.items():
                tally.errors[k] = tally.errors.get(k, 0) + v
        also: dict[str, object] = {}
        if args.also_health_url:
            times2, errors2 = await asyncio.to_thread(received2.recv)
            prober2.join()
            also = {"healthz2_url": args.also_health_url, **health_stats("healthz2", times2), "healthz2_errors": errors2}
    lat, health = tally.latencies, tally.health
    cpu_after = cpu_seconds(args.server_pid) if args.server_pid else None
    # the server's CPU per answered request: steadier than req/s on a shared machine
    cpu_ms = (round(1000 * (cpu_after - cpu_before) / max(1, len(lat) + len(health)), 2)
              if cpu_before is not None and cpu_after is not None else None)
    return {
        "url": args.url, "clients": args.clients, "seconds": round(elapsed, 1), "requests": tally.sent,
        "ok": len(lat), "errors": tally.errors, "req_per_s": round(len(lat) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "p99_ms": round(1000 * percentile(lat, 0.99), 1),
        "max_ms": round(1000 * max(lat), 1) if lat else None,
        **health_stats("healthz", health), "healthz_from": args.health_from, **also,
        "client_loop_lag_p99_ms": round(1000 * percentile(lags, 0.99), 1),
        "client_loop_lag_max_ms": round(1000 * max(lags), 1) if lags else None,
        "server_cpu_ms_per_req": cpu_ms,
        "client_cpu_ms_per_req": round(1000 * own / max(1, tally.sent), 2),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }


def health_stats(name: str, times: list[float]) -> dict[str, object]:
    return {f"{name}_n": len(times),
            f"{name}_p50_ms": round(1000 * statistics.median(times), 1) if times else None,
            f"{name}_p95_ms": round(1000 * percentile(times, 0.95), 1),
            f"{name}_p99_ms": round(1000 * percentile(times, 0.99), 1),
            f"{name}_max_ms": round(1000 * max(times), 1) if times else None}


def run(coro: Any) -> Any:
    """``coro`` on uvloop where it is installed (the ``api`` extra brings it, for the server): the
    clients' share of this machine's CPU, taken from the server it measures, is then about a
    third smaller."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--key", default=os.environ.get("SPECBATCH_LOAD_KEY", ""), help="bearer key, if the server needs one")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30.0, help="stop after this long (at most 600)")
    p.add_argument("--requests", type=int, default=200_000, help="stop after this many requests")
    p.add_argument("--batches", type=int, default=2, help="batches to create and retrieve (needs the broker)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    p.add_argument("--server-pid", type=int, default=0, help="the server's pid: report its CPU per request")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--health-every", type=float, default=0.25, help="seconds between /healthz probes")
    p.add_argument("--health-from", choices=("process", "loop"), default="process",
                   help="probe /healthz from a process of its own (as a load balancer does) or from the "
                        "clients' event loop (the figures before 2026-12-03 16:00)")
    p.add_argument("--health-url", default="", help="probe /healthz here (loopback only; default --url)")
    p.add_argument("--also-health-url", default="",
                   help="a second /healthz probe process beside the first, at this URL (serve --health-port's)")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 1000 or not 0 < args.seconds <= 600 or args.requests < 1:
        p.error("--clients 1..1000, --seconds up to 600, --requests at least 1")
    if not 0.01 <= args.health_every <= 60:
        p.error("--health-every 0.01..60")
    loopback_only(args.url)
    for extra in (args.health_url, args.also_health_url):
        if extra:
            loopback_only(extra)
    return args


if __name__ == "__main__":
    args = parse()
    out = run(main(args))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>16}: {v}")
