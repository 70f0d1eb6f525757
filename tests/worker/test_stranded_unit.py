"""The pieces of stranded-request recovery: what the broker holds (a real redis-server: waiting
tasks, and a task a consumer took and has not acknowledged), which pending rows are candidates,
and the mark that lets one of two racing workers send them (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import update

from specbatch import db
from specbatch.config import Settings
from specbatch.db import session_factory
from specbatch.db.models import Job, Request, RequestStatus, utcnow
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from specbatch.worker import stranded
from specbatch.worker.enqueue import enqueue_requests
from specbatch.worker.stranded import broker_holds, mark_sent, pending_in, without_task
from tests.db.databases import db_url, pg_database, pg_server  # noqa: F401 - fixtures

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


def _job(url: str, queue: str, n: int = 3, meta: dict | None = None, age: float = 120) -> tuple[str, list[int]]:
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(n)]
    with session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue=queue).id
        if meta:
            s.execute(update(Job).where(Job.id == job_id).values(meta=meta))
        ids = store.resumable_request_ids(s, job_id)
        s.execute(update(Request).where(Request.id.in_(ids))
                  .values(created_at=utcnow() - timedelta(seconds=age)))
    return job_id, ids


def _settings(redis_server, tmp_path, **env: str) -> Settings:  # noqa: ANN001
    """Settings of the test's broker and a database of its own: a task names its job's database
    (enqueue_requests reads its id), and without a URL that was the user's default database under
    ~/.local/share, created or migrated by the test (review53b)."""
    return Settings.from_env({"SPECBATCH_BROKER_URL": redis_server.url,
                              "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}", **env})


def test_broker_holds_waiting_and_taken_tasks(redis_server, tmp_path) -> None:  # noqa: ANN001
    from kombu import Connection

    settings = _settings(redis_server, tmp_path, SPECBATCH_CHUNK_SIZE="2")
    assert broker_holds(settings, "q.a") == set()              # empty queue, nothing taken
    enqueue_requests(settings, "job1", [11, 12, 13], "q.a")
    assert broker_holds(settings, "q.a") == {11, 12, 13}       # waiting tasks name them
    with Connection(redis_server.url) as conn:
        queue = conn.SimpleQueue("q.a", no_ack=False)
        taken = [queue.get(timeout=5), queue.get(timeout=5)]   # not acknowledged: in Redis's unacked hash
        assert broker_holds(settings, "q.a") == {11, 12, 13}
        assert broker_holds(settings, "q.b") == set()          # another queue's tasks are not its own
        # nor another database's: its request 12 is not this database's request 12 (review53b)
        db.upgrade(elsewhere := f"sqlite:///{tmp_path / 'elsewhere.db'}")
        enqueue_requests(settings.model_copy(update={"database_url": elsewhere}), "job9", [12, 14], "q.a")
        assert broker_holds(settings, "q.a") == {11, 12, 13}
        assert broker_holds(settings.model_copy(update={"database_url": elsewhere}), "q.a") == {12, 14}
        queue.get(timeout=5).ack()
        for m in taken:
            m.ack()
        queue.close()
    assert broker_holds(settings, "q.a") == set()


def test_candidates_are_old_pending_rows_of_broker_jobs_of_its_queues(db_url: str) -> None:  # noqa: F811
    _, mine = _job(db_url, "q.a")
    _job(db_url, "q.b")                                        # another queue
    _job(db_url, "q.a", meta={"embedded": True})               # `specbatch run` holds it in-process
    _, young = _job(db_url, "q.a", age=0)                     # just submitted: its tasks may be on the way
    with session_factory(db_url).begin() as s:
        found = pending_in(s, ["q.a"], timedelta(seconds=30))
    assert sorted(found) == mine and not set(young) & set(found)


def test_two_workers_marking_at_once_send_each_request_once(db_url: str) -> None:  # noqa: F811
    _, ids = _job(db_url, "q.a", n=40)
    got: list[list[int]] = []
    start = threading.Barrier(2)

    def worker() -> None:
        start.wait()
        with session_factory(db_url).begin() as s:
            got.append(mark_sent(s, ids, 30))
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got[0] + got[1]) == ids                     # each once, by one or the other
    with session_factory(db_url).begin() as s:
        assert pending_in(s, ["q.a"], timedelta(seconds=30)) == {}     # marked: not sent again meanwhile
        assert mark_sent(s, ids, 30) == []


def test_a_queue_longer_than_the_scan_concludes_nothing(redis_server, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    settings = _settings(redis_server, tmp_path, SPECBATCH_CHUNK_SIZE="1")
    enqueue_requests(settings, "job1", [1, 2, 3], "q.long")
    monkeypatch.setattr(stranded, "MAX_SCAN", 2)
    assert broker_holds(settings, "q.long") is None
    monkeypatch.setattr(stranded, "MAX_SCAN", 3)
    assert broker_holds(settings, "q.long") == {1, 2, 3}


def test_requests_lost_behind_another_jobs_waiting_tasks_are_stranded(redis_server, db_url: str) -> None:  # noqa: ANN001, F811
    """A Redis restart, then a new submission: the old job's tasks are gone while the new job's wait
    in the same queue. Only the old job's requests are stranded, and a request whose task waits,
    or a worker took, is not."""
    from kombu import Connection

    settings = Settings.from_env({"SPECBATCH_BROKER_URL": redis_server.url, "SPECBATCH_DATABASE_URL": db_url,
                                  "SPECBATCH_CHUNK_SIZE": "2", "SPECBATCH_LEASE_SWEEP_SECONDS": "30"})
    lost_job, lost = _job(db_url, "q.p", n=3)                  # its tasks were flushed with the broker
    new_job, waiting = _job(db_url, "q.p", n=4)
    enqueue_requests(settings, new_job, waiting, "q.p")
    with session_factory(db_url).begin() as s:
        assert sorted(without_task(settings, s, ["q.p"])) == lost
        assert sorted(without_task(settings, s, ["q.p"], job_id=new_job)) == []
        assert sorted(without_task(settings, s, ["q.p"], job_id=lost_job)) == lost
    with Connection(redis_server.url) as conn:
        queue = conn.SimpleQueue("q.p", no_ack=False)
        taken = queue.get(timeout=5)                           # a worker took one task, not acknowledged
        with session_factory(db_url).begin() as s:
            assert sorted(without_task(settings, s, ["q.p"])) == lost
            s.execute(update(Request).where(Request.id.in_(waiting[:2]))
                      .values(status=RequestStatus.completed))
        taken.ack()                                            # its requests are done
        queue.close()
    enqueue_requests(settings, lost_job, lost, "q.p")          # recovered
    with session_factory(db_url).begin() as s:
        assert without_task(settings, s, ["q.p"]) == {}
