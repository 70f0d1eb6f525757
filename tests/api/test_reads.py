"""The read routes under load (issue 32, item 7): a list or retrieve takes one trip through the
routes' thread pool and answers the JSON that FastAPI rendered before; FastAPI's own telemetry
stays off unless OTEL_* asks for traces; the load script's client and its loopback guard."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from fastapi import FastAPI

from specbatch import db
from specbatch.api.app import _telemetry_off, create_app
from specbatch.config import Settings
from specbatch.jobs import batches, files, store
from specbatch.jobs.intake import ParsedRequest
from tests.api.conftest import KEYS, Api
from tests.worker.services import REPO, RedisServer

PARAMS = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


def _seed(url: str) -> tuple[str, str, str]:
    """(a file id, a batch with a job, a batch that failed at intake: no job)."""
    line = ParsedRequest(line_no=1, custom_id="c0", kind="chat", prompt=None,
                         messages=[{"role": "user", "content": "hi"}], params=PARAMS)
    tally = files.Tally()
    tally.feed(b'{"custom_id": "c0"}\n')
    with db.session_factory(url).begin() as s:
        file_id = files.new_file_id()
        files.add_file(s, file_id=file_id, purpose="batch", filename="in.jsonl", tally=tally)
        job = store.create_job(s, target="t", drafts=["d"], params={}, requests=[line], queue="q")
        running, failed = batches.new_batch_id(), batches.new_batch_id()
        for batch_id, job_id, errors in ((running, job.id, None),
                                         (failed, None, [{"code": "invalid_file", "line": None, "param": None,
                                                          "message": "empty"}])):
            batches.create_batch(s, batch_id=batch_id, input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"k": "v"}, job_id=job_id, errors=errors)
    return file_id, running, failed


def test_a_read_takes_one_trip_through_the_thread_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``def`` route returning a dict went through the pool twice: once to run, once more for
    FastAPI to validate the dict against the return type. The answer is the same JSON."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    file_id, running, failed = _seed(url)
    trips: list[Any] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        trips.append(fn)
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)

    async def read(path: str) -> tuple[int, bytes, str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get(path)
            return r.status_code, r.content, r.headers["content-type"]

    for path in ("/v1/batches", f"/v1/batches/{running}", f"/v1/batches/{failed}", "/v1/files",
                 f"/v1/files/{file_id}"):
        trips.clear()
        status, body, kind = anyio.run(read, path)
        assert (status, kind, len(trips)) == (200, "application/json", 1), path
        obj = json.loads(body)      # FastAPI's JSONResponse rendering: compact, UTF-8 as is
        assert body == json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    with db.session_factory(url).begin() as s:
        expected = batches.batch_objects(s, [batches.get_batch(s, running)])[0]
    assert json.loads(anyio.run(read, f"/v1/batches/{running}")[1]) == expected
    failed_obj = json.loads(anyio.run(read, f"/v1/batches/{failed}")[1])
    assert (failed_obj["status"], failed_obj["errors"]["data"][0]["code"]) == ("failed", "invalid_file")
    # the schema still documents each read's answer, by its model (api.models), not validated per answer
    schema = app.openapi()["paths"]["/v1/batches/{batch_id}"]["get"]["responses"]["200"]
    assert schema["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Batch"}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_sends_the_fewest_statements(tmp_path: Path, request: pytest.FixtureRequest, backend: str) -> None:
    """A list of batches reads them with their jobs in one statement and their request counts and
    usage in another; a retrieve the same; the files' reads one each. On PostgreSQL no read opens a
    transaction (BEGIN and COMMIT would be two more round trips each)."""
    from tests.db.test_api_reads import Sent

    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'r.db'}"
    else:
        from tests.db.databases import empty_tables

        url = request.getfixturevalue("pg_database")
        db.get_engine(url)
        empty_tables(url)
    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    file_id, running, failed = _seed(url)

    async def read(path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get(path)).status_code

    sent_per_read = {}
    for path, fewest in (("/v1/batches", 2), (f"/v1/batches/{running}", 2), (f"/v1/batches/{failed}", 1),
                         ("/v1/files", 1), (f"/v1/files/{file_id}", 1)):
        with Sent(url) as sent:
            assert anyio.run(read, path) == 200
        sent_per_read[path] = (len(sent.statements), fewest)
        assert not any(sent.in_transaction), path
    assert all(n == fewest for n, fewest in sent_per_read.values()), sent_per_read
    db.forget_engines()


def test_a_read_survives_a_postgresql_restart_on_a_connection_not_pinged(
        tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled connection used less than db.IDLE_PING_SECONDS ago is not pinged; when the server
    closed it meanwhile, the read runs again on a new connection instead of answering 500."""
    import psycopg

    from tests.db.databases import PG_ADMIN_DSN, empty_tables

    url = request.getfixturevalue("pg_database")
    db.forget_engines()
    db.get_engine(url)
    empty_tables(url)
    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    file_id, running, _ = _seed(url)
    monkeypatch.setattr(db, "IDLE_PING_SECONDS", 3600.0)

    async def read(path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get(path)).status_code

    try:
        for path in ("/v1/batches", f"/v1/batches/{running}", "/v1/files", f"/v1/files/{file_id}"):
            assert anyio.run(read, path) == 200, path
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:     # a restart, as the pool sees it
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                              [db.get_engine(url).url.database])
            assert anyio.run(read, path) == 200, path
    finally:
        db.forget_engines()


def test_fastapi_telemetry_is_off_unless_otel_asks_for_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    has_it = "telemetry" in inspect.signature(FastAPI).parameters      # FastAPI releases before it: nothing to turn off
    assert _telemetry_off() == ({"telemetry": {"tracing": False, "metrics": False, "logs": False}} if has_it else {})
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert _telemetry_off() == {}


LOAD = [sys.executable, str(REPO / "scripts" / "api_load.py")]


@pytest.fixture
def api(api_redis: RedisServer, tmp_path: Path) -> Any:
    server = Api(tmp_path, api_redis, f"sqlite:///{tmp_path / 'api.db'}", tmp_path / "no-models").start()
    yield server
    server.close()


@pytest.mark.integration
def test_the_load_script_reads_a_running_server_without_errors(api: Api) -> None:
    out = subprocess.run([*LOAD, "--url", api.base, "--key", KEYS[0], "--clients", "4", "--seconds", "2",
                          "--requests", "200", "--batches", "0", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["errors"] == {} and figures["ok"] == figures["requests"] > 0
    assert figures["healthz_n"] >= 1


def test_the_load_script_refuses_a_host_that_is_not_loopback() -> None:
    out = subprocess.run([*LOAD, "--url", "http://192.0.2.1:8000", "--seconds", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "only targets a loopback address" in out.stderr


def _app_and_states(url: str, tmp_path: Path) -> tuple[FastAPI, list[str], str]:
    """An app over ``url`` with batches in several states (running with usage, finished and
    finalizing, cancelling, failed at intake): (app, batch ids, a file id)."""
    from tests.jobs.test_store import output

    app = create_app(Settings.from_env({"SPECBATCH_DATABASE_URL": url, "SPECBATCH_FILES_DIR": str(tmp_path / "f"),
                                        "SPECBATCH_BROKER_URL": "memory://"}))
    app.state.sb.finalizer.schedule = lambda batch_id: None     # a finished batch stays `finalizing`
    file_id, running, failed = _seed(url)
    finished, cancelling = _seed(url)[1], _seed(url)[1]
    with db.session_factory(url).begin() as s:
        for batch_id in (running, finished):
            job_id = batches.get_batch(s, batch_id).job_id
            assert job_id is not None
            ids = store.resumable_request_ids(s, job_id)
            store.claim_requests(s, ids, "w", 60, 4)
            store.record_result(s, ids[0], output(), "w")
        store.refresh_job(s, batches.get_batch(s, running).job_id)
        store.cancel_job(s, str(batches.get_batch(s, cancelling).job_id))
    return app, [running, failed, finished, cancelling], file_id


def _get(app: FastAPI, path: str) -> bytes:
    async def get() -> bytes:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get(path)
            assert r.status_code == 200, (path, r.text)
            return r.content
    return anyio.run(get)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_answers_the_bytes_the_orm_objects_give(tmp_path: Path, request: pytest.FixtureRequest,
                                                       backend: str) -> None:
    """The routes read plain rows; their answers are byte for byte those built from the ORM's
    objects of the same rows (every field of a Batch object, in every state here)."""
    from sqlalchemy import select

    from specbatch.api.files import page
    from specbatch.api.responses import answer
    from specbatch.db.models import ApiBatch

    url = _url(tmp_path, request, backend)
    app, ids, file_id = _app_and_states(url, tmp_path)
    with db.session_factory(url).begin() as s:
        every = sorted(s.scalars(select(ApiBatch)), key=lambda b: (b.created_at, b.id), reverse=True)
        listed = batches.batch_objects(s, every)
        orm = {b["id"]: b for b in listed}
        the_file = files.file_object(files.get_file(s, file_id))
    statuses = {orm[b]["status"] for b in ids}
    assert statuses == {"in_progress", "failed", "finalizing", "cancelling"}, statuses
    assert orm[ids[0]]["usage"]["output_tokens"] == 3
    for b in ids:
        assert _get(app, f"/v1/batches/{b}") == answer(orm[b]).body, b
    assert _get(app, "/v1/batches") == answer(page(listed, False)).body
    assert _get(app, f"/v1/batches?limit=2&after={listed[0]['id']}") == answer(page(listed[1:3], True)).body
    assert _get(app, f"/v1/files/{file_id}") == answer(the_file).body
    assert json.loads(_get(app, "/v1/files"))["data"][-1] == the_file
    db.forget_engines()


def _url(tmp_path: Path, request: pytest.FixtureRequest, backend: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'r.db'}"
    from tests.db.databases import empty_tables

    url = str(request.getfixturevalue("pg_database"))
    db.forget_engines()
    db.get_engine(url)
    empty_tables(url)
    return url


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_builds_no_orm_objects(tmp_path: Path, request: pytest.FixtureRequest, backend: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading rows into ORM objects (identity map, instance state) was most of a read's CPU on
    PostgreSQL; the list and retrieve routes read plain rows."""
    from sqlalchemy.orm import loading

    url = _url(tmp_path, request, backend)
    app, ids, file_id = _app_and_states(url, tmp_path)
    loaded: list[Any] = []
    instances = loading.instances
    monkeypatch.setattr(loading, "instances", lambda *a, **k: loaded.append(a) or instances(*a, **k))
    for path in ("/v1/batches", f"/v1/batches/{ids[0]}", f"/v1/batches/{ids[1]}", "/v1/files",
                 f"/v1/files/{file_id}", f"/v1/files?after={file_id}"):
        _get(app, path)
        assert loaded == [], path
    db.forget_engines()


def test_a_postgresql_read_connection_stays_in_autocommit(tmp_path: Path, request: pytest.FixtureRequest,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's reads run on connections that are in autocommit from the moment they connect; a
    shared pool's connection was switched to autocommit at each checkout and back at each checkin
    (CPU for every read). Writes keep their transactions."""
    import psycopg

    url = _url(tmp_path, request, "postgresql")
    app, ids, file_id = _app_and_states(url, tmp_path)
    paths = ("/v1/batches", f"/v1/batches/{ids[0]}", "/v1/files", f"/v1/files/{file_id}")
    for path in paths:        # the pool's connections are made (and set once) here
        _get(app, path)
    switched: list[bool] = []
    prop = psycopg.Connection.autocommit

    def watch(self: Any, value: bool) -> None:
        switched.append(value)
        prop.fset(self, value)

    monkeypatch.setattr(psycopg.Connection, "autocommit", property(prop.fget, watch))
    for path in paths:
        _get(app, path)
    assert switched == []
    with db.session_factory(url).begin() as s:      # a write: a transaction
        assert s.connection().connection.dbapi_connection.autocommit is False
    db.forget_engines()
