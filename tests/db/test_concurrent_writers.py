"""Four processes writing results at once: no "database is locked", one result row per request."""

from __future__ import annotations

import multiprocessing as mp

from sqlalchemy import func, select

from specbatch import db
from specbatch.db.models import Request, RequestStatus, Result
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from tests.db.writers import write_results

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
PROCS, OWN, SHARED = 4, 30, 12


def test_four_processes_write_results_at_once(db_url):
    n = PROCS * OWN + SHARED
    reqs = [ParsedRequest(line_no=i + 1, custom_id=f"c{i}", kind="completion", prompt="p", messages=None,
                          params=PARAMS) for i in range(n)]
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="t", drafts=["d"], params={}, requests=reqs,
                                  queue="q").id
        ids = store.resumable_request_ids(s, job_id)
    db.forget_engines()                       # nothing inherited; each child opens its own
    shared = ids[PROCS * OWN:]                # every process also races on these

    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=write_results,
                         args=(db_url, job_id, ids[k * OWN:(k + 1) * OWN] + shared, f"w{k}", start, out))
             for k in range(PROCS)]
    for p in procs:
        p.start()
    start.set()
    reports = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    assert [e for _, _, errors in reports for e in errors] == []
    written = [rid for _, w, _ in reports for rid in w]
    assert sorted(written) == sorted(ids)        # each request written exactly once, by someone
    with db.session_factory(db_url).begin() as s:
        assert s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job_id)) == n
        assert s.scalar(select(func.count(func.distinct(Result.request_id)))
                        .where(Result.job_id == job_id)) == n
        assert set(s.scalars(select(Request.status).where(Request.job_id == job_id))) == {
            RequestStatus.completed}
        summary = store.job_summary(s, job_id)
    assert summary["status"] == "completed"
    assert summary["request_counts"]["completed"] == n
    assert summary["stats"]["tokens_generated"] == 2 * n
    assert {w["worker"] for w in summary["stats"]["workers"]} <= {f"w{k}" for k in range(PROCS)}
