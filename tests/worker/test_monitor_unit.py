"""monitor.queue_workers from hand-made remote-control replies (the real ones: test_worker_start)."""

from __future__ import annotations

from specbatch.config import Settings
from specbatch.worker import monitor


def test_consumers_and_workers_starting_for_the_queue_not_others(monkeypatch) -> None:  # noqa: ANN001
    replies = {
        "active_queues": {"a@h": [{"name": "q1"}], "b@h": [], "c@h": [], "d@h": [{"name": "q2"}]},
        "conf": {"a@h": {"task_default_queue": "q1", "specbatch_state": "compiling 1/2 (t graph 1/2), ..."},
                 "b@h": {"task_default_queue": "q1", "specbatch_state": "starting: loading models"},
                 "c@h": {"task_default_queue": "q2", "specbatch_state": "starting: loading models"},
                 "d@h": {"task_default_queue": "specbatch.default"}},
    }
    asked: list[str] = []
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: asked.append(command) or replies[command])
    views = monitor.queue_workers(Settings.from_env({}), "q1")
    assert views == [monitor.WorkerView("a@h", True, "compiling 1/2 (t graph 1/2), ..."),
                     monitor.WorkerView("b@h", False, "starting: loading models")]
    asked.clear()
    assert [v.name for v in monitor.queue_workers(Settings.from_env({}), "q2", states=False) or []] == ["d@h"]
    assert asked == ["active_queues"]            # a consumer exists: no second round trip
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: None)
    assert monitor.queue_workers(Settings.from_env({}), "q1") is None     # broker unreachable
