"""monitor.queue_workers from hand-made remote-control replies (the real ones: test_worker_start)."""

from __future__ import annotations

from specbatch.config import Settings
from specbatch.worker import monitor, scratch


def test_consumers_and_workers_starting_for_the_queue_not_others_in_one_broadcast(monkeypatch) -> None:  # noqa: ANN001
    """One remote-control round trip (worker.panel's command), not two: each waits its whole timeout
    (1 s) for replies, two of them were two seconds of every `status`."""
    replies = {monitor.VIEW_COMMAND: {
        "a@h": {"queues": ["q1"], "default_queue": "q1", "state": "compiling 1/2 (t graph 1/2), ...",
                "database": "d" * 32},
        "b@h": {"queues": [], "default_queue": "q1", "state": "starting: loading models"},
        "c@h": {"queues": [], "default_queue": "q2", "state": "starting: loading models"},
        "d@h": {"queues": ["q2"], "default_queue": "specbatch.default", "state": None}}}
    asked: list[str] = []
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: asked.append(command) or replies[command])
    views = monitor.queue_workers(Settings.from_env({}), "q1")
    assert views == [monitor.WorkerView("a@h", True, "compiling 1/2 (t graph 1/2), ...", database="d" * 32),
                     monitor.WorkerView("b@h", False, "starting: loading models")]
    assert [v.name for v in monitor.queue_workers(Settings.from_env({}), "q2") or []] == ["c@h", "d@h"]
    assert asked == [monitor.VIEW_COMMAND] * 2
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: None)
    assert monitor.queue_workers(Settings.from_env({}), "q1") is None     # broker unreachable


def test_a_worker_of_an_older_specbatch_is_asked_the_built_in_commands(monkeypatch) -> None:  # noqa: ANN001
    """A worker started before an upgrade answers the new command with an error: it still counts."""
    replies = {
        monitor.VIEW_COMMAND: {"a@h": {"error": "KeyError('specbatch_view')"},
                               "b@h": {"queues": [], "default_queue": "q1", "state": "starting: loading models"}},
        "active_queues": {"a@h": [{"name": "q1"}], "b@h": []},
        "conf": {"a@h": {"task_default_queue": "q1", "specbatch_state": "ready (eager)"},
                 "b@h": {"task_default_queue": "q1", "specbatch_state": "starting: loading models"}},
    }
    asked: list[str] = []
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: asked.append(command) or replies[command])
    assert monitor.queue_workers(Settings.from_env({}), "q1") == [
        monitor.WorkerView("a@h", True, "ready (eager)"), monitor.WorkerView("b@h", False, "starting: loading models")]
    assert asked == [monitor.VIEW_COMMAND, "active_queues", "conf"]


def test_a_worker_of_this_machine_is_seen_starting_when_remote_control_hears_nothing(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """Loading its models on a busy machine, a worker answered remote control in more than the
    second it is given: `status` said no worker existed. Its scratch directory says it starts."""
    import os

    settings = Settings.from_env({"SPECBATCH_READY_DIR": str(tmp_path)})
    root = scratch.workers_root(settings)
    for pid, queue, state in ((os.getpid(), "q1", "starting: loading models"), (os.getppid(), "q2", None),
                              (2 ** 22 + 7, "q1", "starting: loading models")):      # (no such process)
        (root / str(pid)).mkdir(parents=True)
        scratch.write_worker(root / str(pid), f"w{pid}@h", queue, settings)
        if state:
            (root / str(pid) / scratch.STATE_FILE).write_text(state + "\n")
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: {})
    me, parent = f"w{os.getpid()}@h", f"w{os.getppid()}@h"
    assert monitor.queue_workers(settings, "q1") == [monitor.WorkerView(me, False, "starting: loading models")]
    assert monitor.queue_workers(settings, "q2") == [monitor.WorkerView(parent, False, monitor.STARTING)]
    (root / str(os.getpid()) / scratch.STATE_FILE).write_text("ready (eager)\n")
    assert monitor.queue_workers(settings, "q1") == [monitor.WorkerView(me, True, "ready (eager)")]
    assert monitor.queue_workers(settings, "q3") == []


def test_a_worker_of_this_machine_on_another_broker_or_database_is_not_counted(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """A new-user walk: `submit` with SPECBATCH_BROKER_URL on Redis db 8, the only worker on db 7:
    no "no live worker" warning, and `status` named the db-7 worker "decoding" while the job sat
    queued. worker.json says where the worker consumes from (a digest, no password in it)."""
    import os

    ready = {"SPECBATCH_READY_DIR": str(tmp_path)}
    db7 = Settings.from_env({**ready, "SPECBATCH_BROKER_URL": "redis://:s3cret@127.0.0.1:6379/7",
                             "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'a.db'}"})
    own = scratch.workers_root(db7) / str(os.getpid())
    own.mkdir(parents=True)
    scratch.write_worker(own, "w@h", "q1", db7)
    (own / scratch.STATE_FILE).write_text("ready (eager)\n")
    assert "s3cret" not in (own / scratch.WORKER_FILE).read_text()
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: {})
    assert monitor.queue_workers(db7, "q1") == [monitor.WorkerView("w@h", True, "ready (eager)")]
    db8 = Settings.from_env({**ready, "SPECBATCH_BROKER_URL": "redis://:s3cret@127.0.0.1:6379/8",
                             "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'a.db'}"})
    assert monitor.queue_workers(db8, "q1") == []
    other_db = Settings.from_env({**ready, "SPECBATCH_BROKER_URL": "redis://:s3cret@127.0.0.1:6379/7",
                                  "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}"})
    assert monitor.queue_workers(other_db, "q1") == []
    monkeypatch.chdir(tmp_path)      # the same file, named by a relative path
    relative = Settings.from_env({**ready, "SPECBATCH_BROKER_URL": "redis://:s3cret@127.0.0.1:6379/7",
                                  "SPECBATCH_DATABASE_URL": "sqlite:///a.db"})
    assert [v.name for v in monitor.queue_workers(relative, "q1") or []] == ["w@h"]


def test_a_worker_that_paused_its_queue_is_named_paused_not_decoding(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """A worker that refused a task (a job of another database) stops consuming its own queue; it
    answers remote control with no queue. `status` then read its scratch directory (written for
    workers that answer too late) and named it "decoding", with no warning, while the job sat
    queued (qa53). A worker that answered is taken at its word: paused."""
    import os

    settings = Settings.from_env({"SPECBATCH_READY_DIR": str(tmp_path)})
    own = scratch.workers_root(settings) / str(os.getpid())
    own.mkdir(parents=True)
    scratch.write_worker(own, "w@h", "q1", settings)
    (own / scratch.STATE_FILE).write_text("eager: auto: compiling gains 1.05x\n")
    replies = {"w@h": {"queues": [], "default_queue": "q1", "state": "eager: auto: compiling gains 1.05x"}}
    monkeypatch.setattr(monitor, "_inspect", lambda s, command, timeout: replies)
    assert monitor.queue_workers(settings, "q1") == [
        monitor.WorkerView("w@h", False, "eager: auto: compiling gains 1.05x", paused=True)]
    assert monitor.queue_workers(settings, "q2") == []


def test_the_loopback_host_names_are_one_broker_and_database() -> None:
    """A worker started with redis://localhost:6379/0 and a submit on redis://127.0.0.1:6379/0 use
    one Redis: `submit` warned "no live worker". Other hosts, ports and databases stay apart."""
    def where(broker: str, database: str = "postgresql://u@localhost:5432/sb") -> str:
        return scratch.source(Settings.from_env({"SPECBATCH_BROKER_URL": broker, "SPECBATCH_DATABASE_URL": database}))

    same = {where(b) for b in ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0", "redis://[::1]:6379/0",
                               "redis://LocalHost:6379/0")}
    assert len(same) == 1
    assert where("redis://:pw@127.0.0.1:6379/0") == where("redis://:other@localhost:6379/0")   # masked anyway
    assert where("redis://localhost:6379/0", "postgresql://u@127.0.0.1:5432/sb") in same
    for other in ("redis://localhost:6380/0", "redis://localhost:6379/1", "redis://10.0.0.2:6379/0"):
        assert where(other) not in same, other
    assert where("redis://localhost:6379/0", "postgresql://u@localhost:5432/other") not in same


def test_a_url_without_a_port_is_the_one_with_the_default_port() -> None:
    """`redis://host` and `redis://host:6379/0` are one Redis (kombu's default port and database),
    as `postgresql://u@host/sb` and `postgresql://u@host:5432/sb` are one PostgreSQL: a worker
    started with one and a `submit` with the other were told apart ("no live worker")."""
    def where(broker: str, database: str = "postgresql+psycopg://u@db.example/sb") -> str:
        return scratch.source(Settings.from_env({"SPECBATCH_BROKER_URL": broker, "SPECBATCH_DATABASE_URL": database}))

    same = {where(b) for b in ("redis://redis.example", "redis://redis.example:6379", "redis://redis.example/",
                               "redis://redis.example:6379/0", "redis://Redis.Example:6379/0")}
    assert len(same) == 1, same
    assert where("redis://redis.example", "postgresql+psycopg://u@db.example:5432/sb") in same
    assert {where("redis://[::1]"), where("redis://localhost:6379/0"), where("redis://127.0.0.1/0")} == {
        where("redis://localhost")}
    for other in ("redis://redis.example:6380", "redis://redis.example/1", "redis://other.example"):
        assert where(other) not in same, other
    assert where("rediss://redis.example") == where("rediss://redis.example:6379/0") != where("redis://redis.example")
    assert where("redis://redis.example", "postgresql+psycopg://u@db.example:5433/sb") not in same
