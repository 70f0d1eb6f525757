"""A task of another database is passed on, later each time, and dropped at last: never a paused queue."""

from __future__ import annotations

import pytest
from celery.exceptions import Reject

from specbatch import db
from specbatch.config import Settings
from specbatch.worker import tasks


class _Retry(Exception):
    def __init__(self, countdown: float) -> None:
        self.countdown = countdown


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
    task = tasks.process_chunk_task
    monkeypatch.setattr(task, "retry", lambda countdown, max_retries: _Retry(countdown))
    monkeypatch.setattr(tasks, "set_consuming", lambda *a, **k: pytest.fail("a queue was paused"))
    waits = []
    for tries in range(tasks.FOREIGN_TRIES):
        task.push_request(id=f"t{tries}", retries=tries, delivery_info={"routing_key": "q"})
        try:
            out = task.pass_on(settings, "job1", "f" * 32)
        finally:
            task.pop_request()
        if isinstance(out, _Retry):
            waits.append(out.countdown)
    assert waits == [5, 10, 20, 40, 80, 160, 300, 300, 300, 300, 300], waits
    assert isinstance(out, Reject) and out.requeue is False
    assert "`specbatch resume job1` with that database's SPECBATCH_DATABASE_URL" in str(out.reason)
    assert task.refused == set()
