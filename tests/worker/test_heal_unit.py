"""take_back_expired on SQLite and PostgreSQL: only its queues' running requests whose lease
expired, each taken once even when two sweepers race."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import select, update

from specbatch.db import session_factory
from specbatch.db.models import Request, RequestStatus, utcnow
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from specbatch.worker.heal import take_back_expired
from tests.db.databases import db_url, pg_database, pg_server  # noqa: F401 - fixtures

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


def _job(url: str, queue: str, n: int = 4) -> list[int]:
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(n)]
    with session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue=queue).id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w-dead", 60, 3)
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
