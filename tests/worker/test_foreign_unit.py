"""A task of another database is passed on, later each time, and dropped at last: never a paused queue."""

from __future__ import annotations

import pytest
from celery.exceptions import Reject

from specbatch import db
from specbatch.config import Settings
from specbatch.worker import tasks


@pytest.fixture
def settings(tmp_path):  # noqa: ANN001
    url = f"sqlite:///{tmp_path / 'w.db'}"
    db.upgrade(url)
    yield Settings(database_url=url)
    db.forget_engines()


def test_each_database_keeps_one_id_of_its_own(tmp_path) -> None:  # noqa: ANN001
    urls = [f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db")]
    for url in urls:
        db.upgrade(url)
    first = [db.database_id(u) for u in urls]
    db.forget_engines()
    assert [db.database_id(u) for u in urls] == first and first[0] != first[1] and len(first[0]) == 32
    db.forget_engines()


def test_a_task_of_another_database_goes_back_later_each_time_then_is_dropped(settings, monkeypatch) -> None:  # noqa: ANN001
    from celery.exceptions import Retry

    monkeypatch.setattr(tasks, "set_consuming", lambda *a, **k: pytest.fail("a queue was paused"))
    waits, kwargs = [], {"database": "f" * 32}
    for tries in range(tasks.FOREIGN_TRIES):
        out = _take(settings, monkeypatch, tries, **kwargs)     # each pass is a retry of the message
        if isinstance(out, Retry):
            waits.append(out.when)
            kwargs = out.sig.kwargs         # what the message sent back carries
    assert waits == [5, 10, 20, 40, 80, 160, 300, 300, 300, 300, 300], waits
    assert isinstance(out, Reject) and out.requeue is False
    assert "`specbatch resume job1` with that database's SPECBATCH_DATABASE_URL" in str(out.reason)
    assert tasks.process_chunk_task.refused == set()


def _take(settings: Settings, monkeypatch, retries: int, **kwargs) -> BaseException:  # noqa: ANN001, ANN003
    """Run the task body as a worker of ``settings``' database would, ``retries`` earlier retries of
    any kind on the message; what it raised. Celery's own retry, eager: the message it would send
    is the Retry's signature."""
    task = tasks.process_chunk_task
    monkeypatch.setattr(tasks, "get_settings", lambda: settings)
    task.push_request(id="t1", retries=retries, args=["job1", [1, 2]], kwargs=kwargs, is_eager=True,
                      called_directly=False, delivery_info={"routing_key": "q"})
    try:
        task.run("job1", [1, 2], **kwargs)
    except BaseException as e:  # noqa: BLE001 - what the task raised is the answer
        return e
    finally:
        task.pop_request()
    raise AssertionError("the task of another database ran")


def test_retries_of_another_kind_do_not_count_as_passes(settings, monkeypatch) -> None:  # noqa: ANN001
    """Celery's request.retries counts every retry of the message: waits for a lease another worker
    held and transient errors in the task's own database, worker-lost resends. Counted as passes, a
    task that had waited on leases 11 times was dropped the first time a worker of another database
    took it ("no worker of that database took it in 12 tries"), and one that had waited 6 times
    went back 300 s later, not 5 (review53b)."""
    from celery.exceptions import Retry

    out = _take(settings, monkeypatch, retries=11, database="f" * 32)
    assert isinstance(out, Retry), out
    assert out.when == 5
    assert list(out.sig.args) == ["job1", [1, 2]]
    assert out.sig.kwargs == {"database": "f" * 32, "passes": 1}      # the database it names goes with it
    out = _take(settings, monkeypatch, retries=30, database="f" * 32, passes=10)
    assert isinstance(out, Retry) and out.when == 300 and out.sig.kwargs["passes"] == 11
    out = _take(settings, monkeypatch, retries=0, database="f" * 32, passes=11)
    assert isinstance(out, Reject) and out.requeue is False and "in 12 tries" in str(out.reason)


def test_a_task_from_a_newer_specbatch_is_passed_on_unread_then_dropped(settings, monkeypatch) -> None:  # noqa: ANN001
    """A newer specbatch that sends tasks with an argument this one does not know (a rolling
    upgrade: workers of both versions on one queue) got every older worker's task failing with
    Celery's TypeError on the unexpected keyword, the queue's requests re-sent by the stranded sweep
    into the same failure. It is passed on for a worker that knows it, as a task of another
    database is, its arguments carried along, and dropped at the last try with what to do."""
    from celery.exceptions import Retry

    monkeypatch.setattr(tasks, "set_consuming", lambda *a, **k: pytest.fail("a queue was paused"))
    monkeypatch.setattr(tasks.EngineTask, "decoder_for", lambda *a, **k: pytest.fail("the task was read"))
    out = _take(settings, monkeypatch, retries=3, priority_class="gold")
    assert isinstance(out, Retry) and out.when == 5, out
    assert out.sig.kwargs == {"priority_class": "gold", "passes": 1}
    out = _take(settings, monkeypatch, retries=0, priority_class="gold", passes=tasks.FOREIGN_TRIES - 1)
    assert isinstance(out, Reject) and out.requeue is False
    assert "sent by a newer specbatch (arguments this worker does not know: priority_class)" in str(out.reason)
    assert "upgrade this job's workers, then `specbatch resume job1`" in str(out.reason)
