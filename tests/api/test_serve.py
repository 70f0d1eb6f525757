"""`specbatch serve` at its edges: no api extra, a busy port, /docs with no internet (issue 26)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'api.db'}")
    monkeypatch.setenv("SPECBATCH_FILES_DIR", str(tmp_path / "files"))


def test_serve_without_the_api_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)       # `import uvicorn` raises ImportError
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 1, result.output
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


def test_serve_with_two_worker_processes_answers_and_stops(tmp_path: Path) -> None:
    """--workers N: N processes on one socket (one Python process uses about one core), each
    building its app from the environment; SIGTERM stops them all."""
    import json
    import os
    import signal
    import subprocess
    import urllib.request

    from tests.worker.services import free_port, wait_for

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "SPECBATCH_BROKER_URL": "memory://", "SPECBATCH_API_KEYS": "k-two"}
    proc = subprocess.Popen([sys.executable, "-c", "from specbatch.cli.main import main; main()", "serve",
                             "--port", str(port), "--workers", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def files() -> object:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/files", headers={"Authorization": "Bearer k-two"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None
    try:
        assert wait_for(files, 60, "serve --workers 2 to answer") == {
            "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "2 processes" in out and "Traceback" not in out, out
    assert proc.returncode == 0, out
