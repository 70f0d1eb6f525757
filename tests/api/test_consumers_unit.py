"""api/consumers.QueueWatch with the workers' answer faked (the real broadcast is in
tests/api/test_api.py): which answers get the server's line, and one broadcast for many batches."""

from __future__ import annotations

import logging

import pytest

from specbatch.api.consumers import QueueWatch
from specbatch.config import Settings
from specbatch.worker import monitor
from specbatch.worker.monitor import WorkerView

HERE, OTHER = "1" * 32, "0" * 32


@pytest.mark.parametrize("workers, warned", [
    ([], True),
    ([WorkerView("w1@h", True, "ready")], False),
    ([WorkerView("w1@h", False, "starting: loading models")], False),      # it will consume
    ([WorkerView("w1@h", False, "decoding", paused=True)], True),
    ([WorkerView("w1@h", True, "ready", database=OTHER)], True),        # passes this database's tasks on
    ([WorkerView("w1@h", True, "ready", database=HERE)], False),
    (None, False),                                                       # the broker is down: not this line's
])
def test_a_batch_gets_the_line_where_no_worker_will_run_it(monkeypatch, caplog, workers, warned) -> None:
    monkeypatch.setattr(monitor, "queue_workers", lambda settings, queue: workers)
    monkeypatch.setattr(monitor, "this_database", lambda settings, ws: HERE)
    watch = QueueWatch(Settings())
    with caplog.at_level(logging.WARNING, logger="specbatch.api.consumers"):
        watch.created("batch_1", ["sb.q"])
        watch.executor.shutdown(wait=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == (["batch batch_1 waits: no live worker consumes queue sb.q; it makes no progress until a "
                      "`specbatch worker` with its target and drafts starts against this server's database "
                      "and broker"] if warned else []), lines


def test_many_batches_of_one_queue_cost_one_broadcast_and_each_gets_its_line(monkeypatch, caplog) -> None:
    asked = []
    monkeypatch.setattr(monitor, "queue_workers", lambda settings, queue: asked.append(queue) or [])
    watch = QueueWatch(Settings())
    with caplog.at_level(logging.WARNING, logger="specbatch.api.consumers"):
        for i in range(5):
            watch.created(f"batch_{i}", ["sb.q"])
        watch.executor.shutdown(wait=True)
    assert asked == ["sb.q"]
    assert [r.getMessage().split(" waits")[0] for r in caplog.records] == [f"batch batch_{i}" for i in range(5)]
    watch.created("batch_late", ["sb.q"])       # after shutdown (the server stopping): no error
