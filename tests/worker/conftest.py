"""Fixtures for worker tests: a real Redis per test, real worker subprocesses, a tmp SQLite file."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specbatch.config import Settings, get_settings
from tests.db.databases import pg_database, pg_server  # noqa: F401 - fixtures
from tests.worker.services import REPO, Proc, RedisServer, free_port, wait_for

CLI = [sys.executable, "-c", "from specbatch.cli.main import main; main()"]  # `specbatch ...`

FAST = {  # short timeouts so redelivery tests finish in seconds
    "SPECBATCH_VISIBILITY_TIMEOUT": "10",
    "SPECBATCH_LEASE_SECONDS": "3",
    "SPECBATCH_MAX_ATTEMPTS": "2",
    "SPECBATCH_CHUNK_SIZE": "2",
}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


class Cluster:
    """Environment shared by this test process and the worker subprocesses it starts."""

    def __init__(self, tmp_path: Path, redis: RedisServer, tiny_models: Path) -> None:
        self.tmp, self.redis, self.models = tmp_path, redis, tiny_models
        self.env = {**os.environ, **FAST, "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}",
                    "SPECBATCH_BROKER_URL": redis.url, "PYTHONPATH": str(REPO),
                    "SPECBATCH_TEST_MODELS": str(tiny_models), "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []

    @property
    def settings(self) -> Settings:
        return Settings.from_env(self.env)

    def worker(self, name: str, target: str = "llama", draft: str = "llama-partial",
               imports: tuple[str, ...] = (), wait: bool = True, extra: tuple[str, ...] = ()) -> Proc:
        argv = [*CLI, "worker"] if not imports else \
            [sys.executable, "-m", "tests.worker.entry", *sum((["--imports", m] for m in imports), [])]
        argv += ["--target", str(self.models / target), "--draft", str(self.models / draft),
                 "-n", f"{name}@%h", *extra]
        if not imports:
            argv += ["--loglevel", "INFO"]
        proc = Proc(argv, self.env, self.tmp / f"worker-{name}-{len(self.procs)}.log")
        self.procs.append(proc)
        if wait:
            self.wait_consuming(proc, target, draft)
        return proc

    def queue(self, target: str = "llama", draft: str = "llama-partial") -> str:
        from specbatch.worker.queues import queue_name

        return queue_name(str(self.models / target), [str(self.models / draft)])

    def wait_consuming(self, proc: Proc, target: str = "llama", draft: str = "llama-partial") -> None:
        from specbatch.worker.monitor import active_queues

        q = self.queue(target, draft)

        def ready() -> bool:
            if proc.proc.poll() is not None:
                raise AssertionError(f"worker exited {proc.proc.returncode}:\n{proc.output()[-3000:]}")
            workers = active_queues(self.settings, timeout=0.5) or {}
            return any(q in qs for qs in workers.values())
        try:
            wait_for(ready, 120, "the worker to load its models and consume", interval=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{proc.output()[-3000:]}") from None

    def flower(self, password: str = "s3cret") -> tuple[Proc, int]:
        port = free_port()
        env = {**self.env, "SPECBATCH_FLOWER_PASSWORD": password, "SPECBATCH_FLOWER_PORT": str(port)}
        proc = Proc([*CLI, "flower"], env, self.tmp / "flower.log")
        self.procs.append(proc)
        return proc, port

    def prompts(self, rows: list[dict[str, Any]]) -> Path:
        path = self.tmp / f"prompts-{len(list(self.tmp.glob('prompts-*')))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    def create_job(self, rows: list[dict[str, Any]], target: str = "llama",
                   draft: str = "llama-partial") -> tuple[str, list[int]]:
        from specbatch.db import session_factory
        from specbatch.jobs import intake, store

        s_ = self.settings
        parsed = intake.parse_file(self.prompts(rows), {}, s_)
        with session_factory(s_.database_url).begin() as s:
            job = store.create_job(s, target=str(self.models / target), drafts=[str(self.models / draft)],
                                   params={}, requests=parsed, queue=self.queue(target, draft))
            return job.id, list(store.resumable_request_ids(s, job.id))

    def submit(self, rows: list[dict[str, Any]], target: str = "llama",
               draft: str = "llama-partial") -> tuple[str, list[int]]:
        from specbatch.worker.enqueue import enqueue_requests

        job_id, ids = self.create_job(rows, target, draft)
        enqueue_requests(self.settings, job_id, ids, self.queue(target, draft))
        return job_id, ids

    def summary(self, job_id: str) -> dict[str, Any]:
        from specbatch.db import session_factory
        from specbatch.jobs import store

        with session_factory(self.settings.database_url).begin() as s:
            return store.job_summary(s, job_id)

    def wait_finished(self, job_id: str, timeout: float = 120) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            summary = self.summary(job_id)
            return summary if summary["status"] in ("completed", "completed_with_errors", "failed") else None
        try:
            return wait_for(done, timeout, f"job {job_id} to finish", interval=0.5)  # type: ignore[return-value]
        except AssertionError as e:
            logs = "\n".join(p.output()[-2500:] for p in self.procs)
            raise AssertionError(f"{e}: {self.summary(job_id)}\n{logs}") from None

    def rows(self, job_id: str) -> list[dict[str, Any]]:
        """One dict per request: status, attempts, error, results (row count), worker of the result."""
        from sqlalchemy import func, select

        from specbatch.db import session_factory
        from specbatch.db.models import Request, Result

        with session_factory(self.settings.database_url).begin() as s:
            out = []
            for r in s.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.id)):
                n = s.scalar(select(func.count()).select_from(Result).where(Result.request_id == r.id))
                worker = s.scalar(select(Result.worker).where(Result.request_id == r.id))
                out.append({"id": r.id, "custom_id": r.custom_id, "status": r.status.value,
                            "attempts": r.attempts, "error": r.error, "results": n, "worker": worker})
            return out

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def cluster(tmp_path: Path, redis_server: RedisServer, tiny_models: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server, tiny_models)
    for k in (*FAST, "SPECBATCH_DATABASE_URL", "SPECBATCH_BROKER_URL"):
        monkeypatch.setenv(k, c.env[k])
    get_settings.cache_clear()
    yield c
    c.close()
