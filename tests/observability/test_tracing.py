"""The span tree of one job, with its context carried across a real Celery hop (real Redis, a real
worker consuming in this process so an in-memory exporter sees both sides)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.observability import tracing
from specbatch.observability import worker as observe

pytestmark = pytest.mark.integration


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    monkeypatch.setattr(observe, "_current", {})
    yield exporter
    tracing.use(None)


@pytest.fixture
def inprocess_worker(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real Celery worker (solo pool) in this process, on the cluster's Redis, holding tiny models."""
    from celery.contrib.testing.worker import start_worker

    from specbatch.worker import tasks  # noqa: F401  (registers the task on the new app)
    from specbatch.worker.app import create_app

    app = create_app(cluster.settings)
    app.conf.update(task_default_queue=cluster.queue(), specbatch_observe={"worker": "obs@test"},
                    specbatch_engine={"target": str(cluster.models / "llama"),
                                      "drafts": [str(cluster.models / "llama-partial")],
                                      "device": "cpu", "dtype": "float32", "batch_size": 1})
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30) as w:
        yield w


def test_one_job_is_one_trace_from_submit_to_each_request(cluster: Any, spans: Any, inprocess_worker: Any,
                                                          tmp_path: Path) -> None:
    prompts = cluster.prompts([{"custom_id": f"r{i}", "prompt": f"Once upon a time {i}",
                                "max_new_tokens": 6 + i} for i in range(3)])
    m = cluster.models
    result = CliRunner().invoke(cli, ["submit", str(prompts), "--target", str(m / "llama"),
                                      "--draft", str(m / "llama-partial"), "--json"])
    assert result.exit_code == 0, result.output
    job_id = __import__("json").loads(result.output[result.output.index("{"):])["job_id"]
    summary = cluster.wait_finished(job_id, timeout=120)
    assert summary["status"] == "completed"

    from tests.worker.services import wait_for
    wait_for(lambda: sum(s.name == "request" for s in spans.get_finished_spans()) == 3, 10, "request spans")
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    children: dict[Any, list[Any]] = defaultdict(list)
    for s in finished:
        if s.parent is not None:
            children[s.parent.span_id].append(s)

    def kids(s: Any) -> list[str]:
        return sorted(c.name for c in children[s.context.span_id])

    assert len({s.context.trace_id for s in finished}) == 1, "one job, one trace"
    (submit,) = [s for s in finished if s.name == "submit"]
    assert submit.parent is None and submit.attributes["specbatch.job.id"] == job_id
    assert kids(submit) == ["enqueue", "intake"]
    (enqueue,) = [s for s in finished if s.name == "enqueue"]
    chunks = [s for s in finished if s.name == "chunk"]
    # FAST chunk_size 2: 3 requests in 2 tasks; each task's span continues the enqueue span it came from
    assert len(chunks) == 2 and all(c.parent.span_id == enqueue.context.span_id for c in chunks)
    assert all(c.parent.is_remote for c in chunks), "the context came through the message headers"
    assert sorted(r for c in chunks for r in c.attributes["specbatch.request_ids"]) == \
        sorted(r["id"] for r in cluster.rows(job_id))
    for c in chunks:
        n = len(c.attributes["specbatch.request_ids"])
        assert kids(c) == sorted(["claim"] * n + ["request"] * n)   # batch 1: one claim per request

    from specbatch.db import session_factory
    from specbatch.db.models import Result
    with session_factory(cluster.settings.database_url).begin() as s:
        results = {r.request_id: (r.completion_tokens, r.accepted_tokens, r.drafted_tokens, r.finish_reason)
                   for r in s.query(Result).filter(Result.job_id == job_id)}
    requests = [s for s in finished if s.name == "request"]
    assert len(requests) == 3
    for r in requests:
        a = r.attributes
        assert results[a["specbatch.request.id"]] == (a["gen_ai.usage.output_tokens"], a["specbatch.tokens.accepted"],
                                                      a["specbatch.tokens.drafted"], a["specbatch.finish_reason"])
        assert kids(r) == ["db.write", "decode", "prefill"]
        parts = {c.name: c for c in children[r.context.span_id]}
        # the phases tile the request: prefill, then decode, then the write, inside the request span
        assert r.start_time == parts["prefill"].start_time <= parts["prefill"].end_time \
            == parts["decode"].start_time <= parts["decode"].end_time == parts["db.write"].start_time \
            <= parts["db.write"].end_time == r.end_time
        assert by_id[r.parent.span_id].name == "chunk"
        chunk = by_id[r.parent.span_id]
        assert chunk.start_time <= r.start_time and r.end_time <= chunk.end_time


def test_specbatch_run_is_one_trace_too(spans: Any, tiny_models: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`specbatch run` (no broker), batched: run -> chunk -> claim + one request span per request."""
    import json

    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'run.db'}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "max_new_tokens": 4 + i}) + "\n"
                               for i in range(3)))
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial"), "--batch-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    finished = spans.get_finished_spans()
    assert len({s.context.trace_id for s in finished}) == 1
    (run,) = [s for s in finished if s.name == "run"]
    assert run.parent is None and run.attributes["specbatch.job.id"] == summary["id"]
    (chunk,) = [s for s in finished if s.name == "chunk"]       # chunk size 8 >= 3 requests
    assert chunk.parent.span_id == run.context.span_id
    requests = [s for s in finished if s.name == "request"]
    assert len(requests) == 3 and all(r.parent.span_id == chunk.context.span_id for r in requests)
    assert sorted(r.attributes["gen_ai.usage.output_tokens"] for r in requests) == [4, 5, 6]
    assert sum(s.name == "claim" for s in finished) == 1            # a batch claims the chunk at once
