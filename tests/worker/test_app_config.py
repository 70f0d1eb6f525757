"""The queue's promises as configuration, queue naming, what a worker logs as it loads (no services needed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from specbatch.config import Settings
from specbatch.engine.compile.decision import CompilePlan
from specbatch.engine.compile.record import CompileReport
from specbatch.worker.app import celery_config, create_app
from specbatch.worker.enqueue import chunks
from specbatch.worker.queues import queue_name


def test_celery_config_keeps_the_queue_promises() -> None:
    conf = celery_config(Settings(database_url="sqlite://", visibility_timeout=123))
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["result_backend"] is None and conf["task_ignore_result"] is True
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"] and conf["task_retry_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["worker_send_task_events"] and conf["task_send_sent_event"]
    assert conf["broker_transport_options"]["visibility_timeout"] == 123


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),      # kombu wrote redis://:**@, logged as :***@
    ("redis://u@h:6379/0", "redis://u@h:6379/0"),                   # a user, no password: u:**@
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://u:s3cret@h:6379/0", "redis://u:***@h:6379/0"),
    ("redis://h:6379/0?password=s3cret", "redis://:***@h:6379/0"),   # (moved into the user part)
])
def test_the_workers_banner_and_log_show_the_broker_url_masked_only_where_it_has_a_password(
        url: str, shown: str) -> None:
    """Celery's banner ("transport: ...") and its "Connected to ..." line print kombu's
    ``Connection.as_uri()``, which wrote ``:**@`` into a URL with no password at all (tidy54): it
    read as if one were set. Flower had the same fix (worker.flower)."""
    app = create_app(Settings(database_url="sqlite://", broker_url=url))
    with app.connection() as conn:
        assert conn.as_uri() == shown
        assert "s3cret" not in repr(conn)
        assert conn.as_uri(include_password=True) == url.replace("h:6379/0?password=s3cret", ":s3cret@h:6379/0")


def test_queue_name_is_derived_from_the_pair(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "m").mkdir()
    a = queue_name(str(tmp_path / "m"), ["smollm2-135m-int8"])
    assert a == queue_name(str(tmp_path / "m") + "/", ["smollm2-135m-int8"])
    assert a != queue_name(str(tmp_path / "m"), ["other"])
    assert a != queue_name(str(tmp_path / "m"), ["smollm2-135m-int8", "ngram"])
    assert a.startswith("specbatch.m+smollm2-135m-int8.")


def test_chunks() -> None:
    assert list(chunks([1, 2, 3, 4, 5], 2)) == [[1, 2], [3, 4], [5]]


@pytest.mark.parametrize(("plan", "logged"), [
    (CompilePlan("auto", False, "auto: compiling needs about 2.0 GiB more memory"),
     ["t: decoding eagerly: auto: compiling needs about 2.0 GiB more memory"]),
    (CompilePlan("off", False, "compile off"), []),
    (CompilePlan("auto", True, "auto: a long-lived worker"), []),
    (CompilePlan("auto", False, "compiling failed, eager instead: boom",     # warned already
                 [CompileReport(model="t", error="boom")]), []),
])
def test_a_worker_logs_why_auto_decodes_eagerly(plan, logged, monkeypatch, caplog) -> None:  # noqa: ANN001
    from specbatch.worker import tasks

    monkeypatch.setattr(tasks, "build_engine", lambda spec, *_: SimpleNamespace(compile_plan=plan, target_name="t"))
    app = create_app(Settings())
    app.conf.specbatch_engine = {"target": "t"}
    task = app.tasks[tasks.TASK_NAME]           # the process's instance of the task class
    with caplog.at_level(logging.INFO, logger="specbatch.worker.tasks"):
        assert task.engine is task.engine       # loaded once: said once
    assert [r.getMessage() for r in caplog.records if "eager" in r.getMessage()] == logged


def test_a_cpu_worker_in_auto_says_why_it_compiles_nothing_in_its_state_and_log(
        tiny_models, tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """The CPU prior at the autopilot's rows is the margin itself (1.05x): the pool child starts no
    background compile, and its state (what `status` and Flower show) and its log say why."""
    from specbatch.config import get_settings
    from specbatch.engine.compile import warmup
    from specbatch.worker import tasks

    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # restored after the test
    get_settings.cache_clear()
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: pytest.fail("nothing compiles"))
    state = tmp_path / "state"
    conf = {"specbatch_engine": {"target": str(tiny_models / "llama"), "drafts": [], "compile": "auto",
                                 "batch_size": 8, "threads": 1},
            "specbatch_state_file": str(state)}
    with caplog.at_level(logging.INFO, logger="specbatch.worker.tasks"):
        engine = tasks.load_engine(conf)
    get_settings.cache_clear()
    why = "auto: compiling gains 1.05x at 8 rows (the least any cpu host measured"
    assert engine.background is None and not engine.compile_plan.enabled and why in engine.compile_plan.reason
    assert state.read_text().startswith(f"eager: {why}"), state.read_text()
    assert any(why in r.getMessage() and "decoding eagerly" in r.getMessage() for r in caplog.records), caplog.text


def test_a_refused_task_is_one_log_line_not_a_traceback(caplog) -> None:  # noqa: ANN001
    """A worker that refuses a task (another database, another pair) raises Reject; Celery logged
    it at WARNING with the raise's stack trace under the line, in every refusing worker's log
    (qa53). The line names the task and the reason; the trace is left out."""
    from celery.exceptions import Reject

    import specbatch.worker.tasks  # noqa: F401  (the worker's log set-up)

    app = create_app(Settings(database_url="sqlite://"))

    @app.task(name="qa53.refused")
    def refused() -> None:
        raise Reject("job x is not in this worker's database", requeue=True)

    with caplog.at_level(logging.INFO, logger="celery.app.trace"):
        refused.apply()
    lines = [r for r in caplog.records if r.name == "celery.app.trace"]
    assert lines and "not in this worker's database" in caplog.text
    assert all(r.exc_info is None and not r.exc_text for r in lines), caplog.text
    assert "Traceback" not in caplog.text
