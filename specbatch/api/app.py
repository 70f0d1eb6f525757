"""The FastAPI app: ``create_app(settings)``; ``specbatch serve`` runs it under uvicorn.

Routes are plain ``def`` where they touch the database (FastAPI runs them in its thread pool of
``SPECBATCH_API_THREADS``, each thread with a kept connection, so the event loop never waits on
SQL); the upload is ``async`` because it streams the body; a keyed route's one dependency
(``auth.Keyed``: the key, the state and the tenant) is ``async`` so that it never queues for that
pool, and ``GET /healthz`` is answered by ``health.HealthFirst`` before the middleware and routing.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute

from specbatch.api.deps import AppState, Finalizer
from specbatch.api.schema import with_400s
from specbatch.config import Settings, otel_traces_exporters
from specbatch.db import read_engine, session_factory

logger = logging.getLogger(__name__)

MAX_JSON_BODY = 1 << 20


def create_app(settings: Settings) -> FastAPI:
    from specbatch.api import batches, errors, files, health, metrics
    from specbatch.api.auth import check_key, require_docs_key
    from specbatch.api.guard import Guard
    from specbatch.api.upload import FORM_OVERHEAD
    from specbatch.jobs.files import sweep_incoming

    if swept := sweep_incoming(settings):
        logger.warning("removed %d unfinished upload(s) left in %s/.incoming", swept, settings.files_dir)
    # routes are plain `def`s run in AnyIO's thread pool: one kept DB connection per thread, so
    # a burst of requests neither waits for a connection nor opens one per request
    factory = session_factory(settings.database_url, pool_size=settings.api_threads)   # migrates on first use
    reader = session_factory(settings.database_url, readonly=True, pool_size=settings.api_threads)
    reads = read_engine(settings.database_url, pool_size=settings.api_threads)
    sb = AppState(settings, factory, reader, Finalizer(settings, factory, reader), reads)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        # the first round of /healthz's checks now: a probe that came first under load waited
        # for a round that took about a second (later probes answer from the last round)
        sb.probe.start(lambda: health.probe_round(sb))
        port = (health.HealthPort(sb, asyncio.get_running_loop(), settings.health_host, settings.health_port)
                if settings.health_port is not None else None)
        app.state.health_port = port
        freeze_startup_heap()
        yield
        gc.unfreeze()       # collectable again: an app stopped in a process that goes on (tests)
        if port is not None:
            port.close()
        if sb.probe.running is not None:
            sb.probe.running.cancel()
        sb.finalizer.close()
        sb.checks.shutdown(wait=False, cancel_futures=True)
        sb.consumers.executor.shutdown(wait=False, cancel_futures=True)

    # FastAPI's own /docs and /redoc load their scripts from a CDN (a blank page offline): /docs is
    # Swagger UI from the swagger-ui-py package instead, and ReDoc is off
    app = FastAPI(title="specbatch", summary="OpenAI-compatible Batch API over specbatch's job queue",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, **_telemetry_off())
    app.state.sb = sb
    errors.install(app)
    app.openapi = with_400s(app.openapi)      # type: ignore[method-assign]
    # the routes themselves, not `include_router`: FastAPI keeps an included router as a branch that
    # a request's path is matched against twice (to find the branch, then inside it), 10-17 us a
    # request against a flat list's matching. Each router carries its own prefix and tags, and every
    # keyed route takes `caller: auth.Keyed` (the key and the state as one dependency: a router-level
    # `Depends(require_key)` would be solved again beside it). The hot routes come first.
    for router in (keyed(files.router), keyed(batches.router), keyed(metrics.router), health.router):
        app.router.routes.extend(router.routes)
    # the schema lists every route and parameter: behind the key like the API itself, unless the
    # operator opens it (SPECBATCH_API_PUBLIC_DOCS=1, for a browser, which sends no bearer key)
    _local_docs(app, [] if settings.api_public_docs else [Depends(require_docs_key)], bool(settings.api_key_list))

    def body_limit(scope: Any) -> int:
        # JSON bodies are small; only the upload streams (and bounds per line) a large one
        if scope["path"] == "/v1/files" and scope["method"] == "POST":
            return settings.max_upload_bytes + FORM_OVERHEAD
        return MAX_JSON_BODY

    app.add_middleware(Guard, limit=body_limit,
                       check_key=lambda headers: check_key(headers, settings.api_key_list))
    app.add_middleware(health.HealthFirst, sb=sb)      # added last: the outermost, before Guard
    return app


def freeze_startup_heap() -> None:
    """Collect once, then ``gc.freeze()``: the objects alive now (modules, the app, its routes and
    pydantic models, SQLAlchemy's metadata: ~130k of a serving process's ~150k) leave the
    collector's generations for good. Under load a full collection (every few seconds at 400 req/s
    a process) traversed them all with the GIL held: 90-130 ms of CPU each (load 8), 0.3-0.65 s of
    wall time, during which no request and no ``/healthz`` was answered; frozen, 13-32 ms CPU
    (docs/bench/api-load.md, "Where /healthz's maximum went"). They are never freed, which costs
    nothing: they live as long as the process. The collection first frees the start-up's cyclic
    garbage, which freezing would otherwise keep."""
    gc.collect()
    gc.freeze()


def keyed(router: APIRouter) -> APIRouter:
    """``router``, checked: every route of it takes ``auth.Keyed``. The key used to be the router's
    own dependency, which no route could leave out; as each route's, one that forgot it would be
    answered to anyone."""
    from specbatch.api.auth import require_key

    for route in router.routes:
        calls = [d.call for d in route.dependant.dependencies] if isinstance(route, APIRoute) else []
        if require_key not in calls:
            raise AssertionError(f"route {getattr(route, 'path', route)!r} does not take `caller: Keyed`: "
                                 "it would answer without the key")
    return router


def _telemetry_off() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry (in the releases that have it) asks the OpenTelemetry API for a
    configured provider on every request: an environment read and three lookups, a few percent of a
    list/retrieve's CPU. Off unless the OTEL_* variables ask for traces."""
    if otel_traces_exporters() or "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def app_from_env() -> FastAPI:
    """The app of one ``specbatch serve --workers N`` process (uvicorn imports it by name)."""
    from specbatch.config import get_settings

    return create_app(get_settings())


DOCS_ASSETS = "/docs-assets"
OPENAPI_URL = "/openapi.json"


def _local_docs(app: FastAPI, dependencies: list[Any], keyed: bool) -> None:
    """``/docs`` and ``/openapi.json``, each behind ``dependencies`` (the key, unless the docs are
    public). ``/docs``: Swagger UI served from the ``swagger-ui-py`` package's files (the ``api`` extra),
    so it works with no internet access (FastAPI, "Self-hosting JavaScript and CSS for docs").
    Swagger UI 5: FastAPI's schema is OpenAPI 3.1, which Swagger UI 4 (swagger-ui-bundle, the
    package used before) refuses with "Unable to render this definition"."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import HTMLResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_static())), name="docs-assets")

    @app.get(OPENAPI_URL, include_in_schema=False, dependencies=dependencies)
    async def openapi() -> JSONResponse:
        schema = app.openapi()      # built once and kept by FastAPI: marked once
        if keyed and "security" not in schema:
            _bearer_security(schema)
        return JSONResponse(schema)

    @app.get("/docs", include_in_schema=False, dependencies=dependencies)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title="specbatch API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def _bearer_security(schema: dict[str, Any]) -> None:
    """Declare the bearer key in the schema (no route reads it from there: ``require_key`` checks
    it), so Swagger UI shows its Authorize button and "Try it out" sends the key; /healthz needs none."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer", "description": "one of SPECBATCH_API_KEYS"}
    schema["security"] = [{"bearer": []}]
    for operation in schema.get("paths", {}).get("/healthz", {}).values():
        operation["security"] = []


def swagger_ui_static() -> Path:
    """The Swagger UI files of ``swagger-ui-py``, found without importing it (its import pulls
    in a templating server we do not use)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'swagger_ui'", name="swagger_ui")
    return Path(next(iter(spec.submodule_search_locations))) / "static"
