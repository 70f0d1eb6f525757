"""take_back_expired on SQLite and PostgreSQL: only its queues' running requests whose lease
expired, each taken once even when two sweepers race; a cancelling job held up by a dead worker's
lease is ended by the sweep; which lease holders are known to be gone."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import select, update

from specbatch.db import session_factory
from specbatch.db.models import Request, RequestStatus, utcnow
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from specbatch.worker.heal import end_cancelling, take_back_expired
from specbatch.worker.pids import gone_here
from tests.db.databases import db_url, pg_database, pg_server  # noqa: F401 - fixtures
from tests.worker.services import wait_for

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


def _job(url: str, queue: str, n: int = 4, metadata: dict | None = None, holder: str = "w-dead") -> list[int]:
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(n)]
    with session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue=queue, metadata=metadata).id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, holder, 60, 3)
    return ids


def _expire(url: str, ids: list[int]) -> None:
    with session_factory(url).begin() as s:
        s.execute(update(Request).where(Request.id.in_(ids)).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def test_only_expired_leases_of_its_queues_are_taken_back_once(db_url: str) -> None:  # noqa: F811
    mine, other = _job(db_url, "sb.mine"), _job(db_url, "sb.other")
    _expire(db_url, mine[:3] + other)               # mine[3] is still leased by a live worker
    with session_factory(db_url).begin() as s:
        taken = take_back_expired(s, {"sb.mine"})
    assert list(taken.values()) == [mine[:3]] and next(iter(taken))[1] == "sb.mine"
    with session_factory(db_url).begin() as s:
        status = dict(s.execute(select(Request.id, Request.status)).all())
        assert take_back_expired(s, {"sb.mine"}) == {}          # nothing left to take
    assert [status[i] for i in mine] == [RequestStatus.pending] * 3 + [RequestStatus.running]
    assert {status[i] for i in other} == {RequestStatus.running}


def test_a_request_taken_back_keeps_its_last_holders_name_for_its_failure(db_url: str) -> None:  # noqa: F811
    """The sweep takes a dead worker's request back; when it has then used every attempt, the
    next claim fails it naming the worker it killed (the CI flake at stop 56: whether the sweep or
    a redelivered task reached it first decided whether the name was there)."""
    ids = _job(db_url, "sb.mine", n=1, holder="w1@box:7")
    with session_factory(db_url).begin() as s:
        store.start_requests(s, ids, "w1@box:7")
        s.execute(update(Request).where(Request.id.in_(ids)).values(attempts=3))
    _expire(db_url, ids)
    with session_factory(db_url).begin() as s:
        assert take_back_expired(s, {"sb.mine"})
    with session_factory(db_url).begin() as s:
        assert store.claim_requests(s, ids, "w2@box:8", 60, 3) == []
        row = s.get(Request, ids[0])
        assert row is not None and row.status == RequestStatus.failed
        assert row.error is not None and row.error.endswith("died each time (last: w1@box:7)"), row.error


def test_a_run_jobs_expired_rows_are_never_taken_back_by_a_worker(db_url: str) -> None:  # noqa: F811
    """A `specbatch run` job decodes in that process (its `resume` takes a dead one's rows back);
    a worker consuming the same pair's queue must not send them to itself, as stranded.pending_in
    does not either (one predicate: store.run_in_its_process)."""
    ids = _job(db_url, "sb.pair", metadata={"embedded": True}, holder="embedded@box:1")
    _expire(db_url, ids)
    with session_factory(db_url).begin() as s:
        assert take_back_expired(s, {"sb.pair"}) == {}
        assert set(s.scalars(select(Request.status).where(Request.id.in_(ids)))) == {RequestStatus.running}


def test_two_sweepers_racing_take_each_request_once(db_url: str) -> None:  # noqa: F811
    ids = _job(db_url, "sb.race", n=20)
    _expire(db_url, ids)
    got: list[list[int]] = []
    barrier = threading.Barrier(2)

    def sweeper() -> None:
        with session_factory(db_url).begin() as s:
            barrier.wait()
            got.append([i for v in take_back_expired(s, {"sb.race"}).values() for i in v])
    threads = [threading.Thread(target=sweeper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got[0] + got[1]) == ids, got


def test_a_cancelling_job_held_by_a_dead_workers_lease_ends_at_the_sweep(db_url: str) -> None:  # noqa: F811
    ids = _job(db_url, "sb.cancel")
    with session_factory(db_url).begin() as s:
        job_id = s.scalar(select(Request.job_id).where(Request.id == ids[0]))
        store.cancel_job(s, job_id)
        assert end_cancelling(s) == []          # the leases are live: their worker may still drop them
    _expire(db_url, ids)
    with session_factory(db_url).begin() as s:
        assert end_cancelling(s) == [job_id]
        assert store.get_job(s, job_id).status.value == "cancelled"
        assert set(s.scalars(select(Request.status).where(Request.id.in_(ids)))) == {RequestStatus.cancelled}
        assert take_back_expired(s, {"sb.cancel"}) == {} and end_cancelling(s) == []


def test_a_lease_holder_is_gone_only_when_it_ran_here_and_exited() -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert gone_here(f"specbatch-9@box:{proc.pid}", host="box")
    assert gone_here(f"embedded@box:{proc.pid}", host="box")
    assert not gone_here(f"specbatch-9@box:{os.getpid()}", host="box")        # still runs
    assert not gone_here(f"specbatch-9@other:{proc.pid}", host="box")         # another machine's
    for odd in ("w-dead", "box:12x", "", "@:1"):
        assert not gone_here(odd, host="box")
    # exited but not reaped: a SIGKILLed worker's pool child where no init reaps orphans
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 30,
             "the child to exit")
    assert gone_here(f"specbatch-9@box:{zombie.pid}", host="box")
    zombie.wait()


def test_a_killed_run_process_keeps_its_rows_attempts_charged_as_a_killed_worker(db_url: str) -> None:  # noqa: F811
    """release_dead_embedded (resume, run --resume) frees a dead `specbatch run` process's rows at
    once, as expire_gone_leases does a killed worker's: the attempt of a row that began decoding
    stays charged (it may be what killed the process), so after max_attempts it fails alone."""
    import socket
    import subprocess
    import sys

    from specbatch.worker.embedded_names import release_dead_embedded

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = f"embedded@{socket.gethostname()}:{proc.pid}"
    ids = _job(db_url, "sb.run", metadata={"embedded": True}, holder=dead)
    with session_factory(db_url).begin() as s:
        store.start_requests(s, ids[:2], dead)          # two began decoding, two waited behind them
        job_id = s.scalar(select(Request.job_id).where(Request.id == ids[0]))
        assert store.resumable_request_ids(s, job_id) == []       # live leases: nothing to resume yet
        assert release_dead_embedded(s, job_id) == ids
        assert store.resumable_request_ids(s, job_id) == ids
        attempts = dict(s.execute(select(Request.id, Request.attempts).where(Request.id.in_(ids))).all())
    assert [attempts[i] for i in ids] == [1, 1, 0, 0]
    with session_factory(db_url).begin() as s:       # a resume claims them: the last attempt fails them
        claimed = store.claim_requests(s, ids, "embedded@box:2", 60, max_attempts=1)
    assert [c.id for c in claimed] == ids[2:]


def test_held_by_gone_names_a_killed_holders_live_leases_and_changes_nothing(db_url: str) -> None:  # noqa: F811
    """What `status` shows (read-only): the live leases of a holder that ran here and exited;
    `expire_gone_leases` (resume, cancel) ends exactly those."""
    import socket
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = f"celery@{socket.gethostname()}:{proc.pid}"
    ids = _job(db_url, "sb.q", holder=dead)
    live = _job(db_url, "sb.q", holder="celery@elsewhere:1")
    with session_factory(db_url).begin() as s:
        job_id, other = (s.scalar(select(Request.job_id).where(Request.id == i)) for i in (ids[0], live[0]))
        assert store.held_by_gone(s, job_id, gone_here) == {dead: ids}
        assert store.held_by_gone(s, other, gone_here) == {}
    with session_factory(db_url).begin() as s:           # nothing expired by looking
        assert len(store.leased_requests(s, job_id)) == len(ids)
        assert store.expire_gone_leases(s, job_id, gone_here) == {dead: ids}
        assert store.held_by_gone(s, job_id, gone_here) == {}
