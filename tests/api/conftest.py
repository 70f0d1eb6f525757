"""Fixtures for the HTTP API: a real `specbatch serve` subprocess on a free port, a real Redis, the
official `openai` client; SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.db.databases import pg_database, pg_server  # noqa: F401 - fixtures
from tests.worker.conftest import FAST
from tests.worker.services import REPO, Proc, RedisServer, free_port, wait_for

CLI = [sys.executable, "-c", "from specbatch.cli.main import main; main()"]
KEYS = ("sk-test-one", "sk-test-two")
LIMITS = {"SPECBATCH_MAX_UPLOAD_BYTES": "60000", "SPECBATCH_MAX_REQUESTS": "200",
          # a fixed size: its gamma controller drafts from the first step, so the spec-decode
          # counters have something to count (auto speculates only once a trial is affordable)
          "SPECBATCH_BATCH_SIZE": "4"}


class Api:
    """A running `specbatch serve` and the environment it shares with workers started beside it."""

    def __init__(self, tmp: Path, redis: RedisServer, db_url: str, models: Path) -> None:
        self.tmp, self.redis, self.db_url, self.models = tmp, redis, db_url, models
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **FAST, **LIMITS, "SPECBATCH_DATABASE_URL": db_url,
                    "SPECBATCH_BROKER_URL": redis.url, "SPECBATCH_FILES_DIR": str(tmp / "files"),
                    "SPECBATCH_API_KEYS": ",".join(KEYS), "PYTHONPATH": str(REPO),
                    "SPECBATCH_TEST_MODELS": str(models), "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []

    def start(self, healthy: bool = True) -> Api:
        proc = Proc([*CLI, "serve", "--port", str(self.port)], self.env, self.tmp / "serve.log")
        self.procs.append(proc)

        def up() -> bool:
            if proc.proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.proc.returncode}:\n{proc.output()[-3000:]}")
            try:
                status = self.get("/healthz")[0]
            except OSError:
                return False
            return status == 200 or not healthy
        wait_for(up, 60, "specbatch serve to answer /healthz")
        return self

    def client(self, key: str | None = KEYS[0]) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or "", max_retries=0, timeout=30)

    def request(self, method: str, path: str, key: str | None = KEYS[0], body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A raw HTTP call: (status, body) whatever the status."""
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers or {})
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path: str, key: str | None = KEYS[0]) -> tuple[int, Any]:
        status, body = self.request("GET", path, key)
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def worker(self, target: str = "llama", draft: str = "llama-partial") -> Proc:
        from tests.worker.conftest import Cluster

        cluster = Cluster(self.tmp, self.redis, self.models)
        cluster.env = {**self.env}
        proc = cluster.worker("api", target=target, draft=draft)
        self.procs.extend(cluster.procs)
        return proc

    def upload(self, rows: list[dict[str, Any]] | str, name: str = "in.jsonl") -> Any:
        text = rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows)
        return self.client().files.create(file=(name, text.encode()), purpose="batch")

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def chat_line(i: int, max_tokens: int = 4, content: str = "Write a haiku about queues") -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens}}


@pytest.fixture(scope="module")
def api_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def start_api(request: pytest.FixtureRequest, backend: str, redis: RedisServer, models: Path,
              tmp: Path) -> Api:
    if backend == "sqlite":
        url = f"sqlite:///{tmp / 'api.db'}"
    else:
        url = request.getfixturevalue("pg_database")
        from specbatch.db import get_engine
        from tests.db.databases import empty_tables
        get_engine(url)
        empty_tables(url)
    return Api(tmp, redis, url, models).start()


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The API in this process (FastAPI's test client) over a fresh SQLite database, no keys: for
    what a request's handling says, not the service around it. A server error comes back as a 500
    response, not an exception, as a real client would see it."""
    from fastapi.testclient import TestClient

    from specbatch.api.app import create_app
    from specbatch.config import get_settings

    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'api.db'}")
    monkeypatch.setenv("SPECBATCH_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.delenv("SPECBATCH_API_KEYS", raising=False)
    get_settings.cache_clear()
    try:
        with TestClient(create_app(get_settings()), raise_server_exceptions=False) as c:
            yield c
    finally:
        get_settings.cache_clear()
