"""The store's operations on SQLite and PostgreSQL: claims and leases, idempotent results, lifecycle."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from specbatch import db
from specbatch.db.models import Job, JobStatus, Request, RequestStatus, Result, utcnow
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats
from specbatch.errors import JobNotFound, SpecBatchError
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest

PARAMS = {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "stop": ["\n"]}


def make_job(url: str, n: int = 4, **kw) -> tuple[str, list[int]]:
    reqs = [ParsedRequest(line_no=i + 1, custom_id=f"c{i}", kind="completion", prompt=f"prompt {i}",
                          messages=None, params=PARAMS) for i in range(n)]
    with db.session_factory(url).begin() as s:
        job = store.create_job(s, target=kw.get("target", "tgt"), drafts=["d1", "ngram"],
                               params={"max_new_tokens": 8}, requests=reqs, queue="q", source="p.jsonl",
                               metadata={"who": "test"})
        return job.id, store.resumable_request_ids(s, job.id)


def output(new_tokens: int = 3, drafted: int = 4, accepted: int = 2, steps: int = 2, wall: float = 0.5,
           **kw) -> GenerationOutput:
    stats = GenerationStats(prompt_tokens=5, new_tokens=new_tokens, verify_steps=steps, drafted_tokens=drafted,
                            accepted_tokens=accepted, accepted_per_position=kw.get("app", [0.5, 0.25]),
                            target_forwards=steps, draft_forwards=drafted, draft_seconds=0.1,
                            verify_seconds=0.3, wall_seconds=wall, pool_wins=kw.get("wins", {"d1": 1}),
                            final_gamma=4)
    return GenerationOutput(text="out", token_ids=list(range(new_tokens)), finish_reason="length", stats=stats)


def counts_from_rows(s, job_id: str) -> dict[str, int]:
    rows = s.execute(select(Request.status, func.count()).where(Request.job_id == job_id)
                     .group_by(Request.status)).all()
    out = {k: 0 for k in store.COUNT_NAMES}
    for status, n in rows:
        out[RequestStatus(status).value] = n
        out["total"] += n
    return out


def test_create_job_and_get_it_back(db_url):
    job_id, ids = make_job(db_url, 3)
    with db.session_factory(db_url).begin() as s:
        job = store.get_job(s, job_id)
        assert (job.status, job.total, job.pending, job.target, job.drafts, job.queue) == (
            JobStatus.queued, 3, 3, "tgt", ["d1", "ngram"], "q")
        assert job.meta == {"who": "test"} and job.source == "p.jsonl"
        assert store.get_job(s, job_id[:6]).id == job_id                  # unique prefix
        with pytest.raises(JobNotFound, match="no job 'zzzz'; "):
            store.get_job(s, "zzzz")
        with pytest.raises(JobNotFound, match=r"a prefix needs at least 4 characters"):
            store.get_job(s, job_id[:3])                                   # too short to match
        reqs = s.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.id)).all()
        assert [r.custom_id for r in reqs] == ["c0", "c1", "c2"] and [r.id for r in reqs] == ids
        assert reqs[0].params == PARAMS and reqs[0].attempts == 0


def test_list_jobs_newest_first(db_url):
    first, _ = make_job(db_url, 1)
    second, _ = make_job(db_url, 1)
    with db.session_factory(db_url).begin() as s:
        s.execute(update(Job).where(Job.id == first).values(created_at=utcnow() - timedelta(hours=1)))
        assert [j.id for j in store.list_jobs(s)] == [second, first]
        assert [j.id for j in store.list_jobs(s, limit=1)] == [second]


def test_claim_takes_a_lease_and_starting_counts_the_attempt(db_url):
    job_id, ids = make_job(db_url, 3)
    f = db.session_factory(db_url)
    with f.begin() as s:
        claimed = store.claim_requests(s, ids[:2], "w1", 60, 3)
    assert [c.id for c in claimed] == ids[:2]
    c = claimed[0]
    assert (c.job_id, c.custom_id, c.prompt, c.messages, c.attempts) == (job_id, "c0", "prompt 0", None, 0)
    assert c.params == GenerationParams(max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=3,
                                        stop=("\n",))
    with f.begin() as s:
        r = s.get(Request, ids[0])
        assert r.status == RequestStatus.running and r.worker == "w1"
        assert timedelta(seconds=50) < r.lease_expires_at - utcnow() <= timedelta(seconds=60)
        assert (r.attempts, r.started_at) == (0, None)          # held, not yet decoding
        job = store.get_job(s, job_id)
        assert job.status == JobStatus.running and job.started_at is not None
    with f.begin() as s:
        again = store.claim_requests(s, ids, "w2", 60, 3)
    assert [c.id for c in again] == [ids[2]]
    with f.begin() as s:
        store.start_requests(s, ids[:1], "w1")
        store.start_requests(s, ids[1:2], "w-other")               # not its claim: nothing happens
        rows = [s.get(Request, i) for i in ids[:2]]
        assert [r.attempts for r in rows] == [1, 0]
        assert rows[0].started_at is not None and rows[1].started_at is None


def test_release_undoes_only_the_attempts_of_started_requests(db_url):
    """Ctrl-C / an outage gives claims back: a request that began decoding is not blamed for it,
    and one that only waited behind the batch was never charged."""
    job_id, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        s.execute(update(Request).where(Request.id == ids[1]).values(attempts=1))   # a suspect
        store.claim_requests(s, ids, "w", 60, 3)
        store.start_requests(s, ids[:1], "w")
    with f.begin() as s:
        assert store.release_held_by(s, job_id, "w") == ids
    with f.begin() as s:
        rows = [s.get(Request, i) for i in ids]
        assert [(r.status, r.attempts, r.started_at) for r in rows] == [
            (RequestStatus.pending, 0, None), (RequestStatus.pending, 1, None)]


def test_expired_lease_is_claimed_again_until_max_attempts(db_url):
    job_id, ids = make_job(db_url, 1)
    f = db.session_factory(db_url)
    for attempt in (1, 2):
        with f.begin() as s:
            got = store.claim_requests(s, ids, f"w{attempt}", 0, 2)     # lease 0 s: expires at once
            assert [c.attempts for c in got] == [attempt - 1]          # decodes begun before
            if attempt == 2:   # a worker that dies before decoding what it claimed costs nothing
                assert [c.attempts for c in store.claim_requests(s, ids, "w-idle", 0, 2)] == [1]
            store.start_requests(s, ids, s.get(Request, ids[0]).worker)   # ... it dies decoding
    with f.begin() as s:
        assert store.resumable_request_ids(s, job_id) == ids          # running, but nobody holds it
        assert store.claim_requests(s, ids, "w3", 60, 2) == []
        r = s.get(Request, ids[0])
        assert r.status == RequestStatus.failed
        assert r.error == "attempted 2 times, the process decoding it died each time (last: w-idle)"
        assert store.refresh_job(s, job_id).status == JobStatus.failed


def test_one_attempt_is_worded_in_the_singular(db_url):
    job_id, ids = make_job(db_url, 1)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w1", 0, 1)
        store.start_requests(s, ids, "w1")          # ... and dies decoding; SPECBATCH_MAX_ATTEMPTS=1
    with f.begin() as s:
        assert store.claim_requests(s, ids, "w2", 60, 1) == []
        # (qa51: "the worker" also where the process that died was a `specbatch run`)
        assert s.get(Request, ids[0]).error == "attempted 1 time, the process decoding it died each time (last: w1)"


def test_finished_requests_are_never_claimed(db_url):
    job_id, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 0, 5)
        store.record_result(s, ids[0], output(), "w")
        store.record_failure(s, ids[1], "prompt too long", "w")
    with f.begin() as s:
        assert store.claim_requests(s, ids, "w", 60, 5) == []
        assert store.resumable_request_ids(s, job_id) == []


def test_renew_leases_only_for_the_holder(db_url):
    _, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w1", 10, 3)
        store.renew_leases(s, ids, "w1", 600)
        store.renew_leases(s, ids, "w2", 1)                      # not its leases: no effect
        leases = [s.get(Request, i).lease_expires_at - utcnow() for i in ids]
    assert all(timedelta(seconds=590) < d <= timedelta(seconds=600) for d in leases)


def test_record_result_is_an_idempotent_upsert(db_url):
    job_id, ids = make_job(db_url, 1)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w1", 60, 3)
        store.start_requests(s, ids, "w1")
    with f.begin() as s:
        assert store.record_result(s, ids[0], output(), "w1") is True
    with f.begin() as s:        # a redelivered task writes the same result again
        assert store.record_result(s, ids[0], output(new_tokens=9), "w2") is False
    with f.begin() as s:
        results = s.scalars(select(Result).where(Result.request_id == ids[0])).all()
        assert len(results) == 1
        res = results[0]
        assert (res.text, res.token_ids, res.prompt_tokens, res.completion_tokens, res.finish_reason,
                res.worker) == ("out", [0, 1, 2], 5, 3, "length", "w1")
        assert (res.drafted_tokens, res.accepted_tokens, res.acceptance_rate, res.mean_acceptance_length,
                res.verify_steps, res.target_forwards, res.draft_forwards) == (4, 2, 0.5, 2.0, 2, 2, 4)
        assert (res.accepted_per_position, res.pool_wins, res.final_gamma) == ([0.5, 0.25], {"d1": 1}, 4)
        assert (res.draft_seconds, res.verify_seconds, res.wall_seconds, res.tokens_per_second) == (
            0.1, 0.3, 0.5, 6.0)
        assert res.started_at is not None and res.finished_at >= res.started_at
        assert res.latency_seconds == pytest.approx((res.finished_at - res.started_at).total_seconds())
        r = s.get(Request, ids[0])
        assert (r.status, r.lease_expires_at) == (RequestStatus.completed, None)
        # a late failure report does not undo a completed request
        store.record_failure(s, ids[0], "late", "w3")
        assert s.get(Request, ids[0]).status == RequestStatus.completed


def test_job_status_follows_the_rows(db_url):
    job_id, ids = make_job(db_url, 3)
    f = db.session_factory(db_url)
    with f.begin() as s:
        assert store.refresh_job(s, job_id).status == JobStatus.queued
        store.claim_requests(s, ids, "w", 60, 3)
        job = store.refresh_job(s, job_id)
        assert (job.status, job.running, job.pending) == (JobStatus.running, 3, 0)
        store.record_result(s, ids[0], output(), "w")
        store.record_result(s, ids[1], output(), "w")
        assert store.refresh_job(s, job_id).status == JobStatus.running
        store.record_failure(s, ids[2], "bad prompt", "w")
        job = store.refresh_job(s, job_id)
        assert (job.status, job.completed, job.failed, job.running) == (JobStatus.completed_with_errors, 2, 1, 0)
        assert job.finished_at is not None and job.started_at <= job.finished_at
        assert store.request_counts(s, [job_id])[job_id] == counts_from_rows(s, job_id)


def test_all_completed_and_all_failed(db_url):
    ok_id, ok = make_job(db_url, 2)
    bad_id, bad = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ok + bad, "w", 60, 3)
        for i in ok:
            store.record_result(s, i, output(), "w")
        for i in bad:
            store.record_failure(s, i, "boom", "w")
        assert store.refresh_job(s, ok_id).status == JobStatus.completed
        assert store.refresh_job(s, bad_id).status == JobStatus.failed


def test_retry_resets_only_failed_requests(db_url):
    job_id, ids = make_job(db_url, 3)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.start_requests(s, ids, "w")
        store.record_result(s, ids[0], output(), "w")
        store.record_failure(s, ids[1], "boom", "w")
        store.record_failure(s, ids[2], "boom", "w")
        store.refresh_job(s, job_id)
    with f.begin() as s:
        assert store.retry_failed(s, job_id) == ids[1:]
        rows = [s.get(Request, i) for i in ids]
        assert [(r.status, r.attempts, r.error) for r in rows] == [
            (RequestStatus.completed, 1, None), (RequestStatus.pending, 0, None), (RequestStatus.pending, 0, None)]
        job = store.get_job(s, job_id)
        assert (job.status, job.finished_at, job.pending) == (JobStatus.running, None, 2)
        assert store.retry_failed(s, job_id) == []                 # nothing failed any more
        claimed = store.claim_requests(s, ids, "w", 60, 3)
        assert [c.id for c in claimed] == ids[1:]                 # the completed one is not redone
        for c in claimed:
            store.record_result(s, c.id, output(), "w")
        assert store.refresh_job(s, job_id).status == JobStatus.completed
        assert s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job_id)) == 3


def test_cancel_drops_pending_keeps_results_and_waits_for_running(db_url):
    job_id, ids = make_job(db_url, 4)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids[:2], "w", 60, 3)
        store.record_result(s, ids[0], output(), "w")
    with f.begin() as s:
        job = store.cancel_job(s, job_id)
        assert job.status == JobStatus.cancelling and job.cancel_requested_at is not None
        assert store.request_counts(s, [job_id])[job_id] == {
            "total": 4, "pending": 0, "running": 1, "completed": 1, "failed": 0, "cancelled": 2}
        assert job.status == JobStatus.cancelling
        assert store.resumable_request_ids(s, job_id) == []
    with f.begin() as s:        # the running one finishes; its result is kept
        assert store.record_result(s, ids[1], output(), "w")
        job = store.refresh_job(s, job_id)
        assert job.status == JobStatus.cancelled and job.cancelled_at is not None
        assert (job.completed, job.cancelled) == (2, 2)
        with pytest.raises(SpecBatchError, match="cancelled job cannot be retried"):
            store.retry_failed(s, job_id)
        assert store.cancel_job(s, job_id).status == JobStatus.cancelled     # again: no change


def test_cancel_claims_of_a_cancelled_job(db_url):
    job_id, ids = make_job(db_url, 3)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids[:1], "w", 60, 3)       # running with a live lease
        store.claim_requests(s, ids[1:2], "w", 0, 3)       # running, worker gone (lease expired)
        job = store.cancel_job(s, job_id)
        assert job.status == JobStatus.cancelling           # ids[0] still generating
        assert s.get(Request, ids[1]).status == RequestStatus.cancelled
        # the worker's next claim (its cancellation check) finds nothing to do
        assert store.claim_requests(s, ids, "w", 60, 3) == []
        assert s.get(Request, ids[0]).status == RequestStatus.running


def test_claim_marks_requests_of_a_cancelling_job_cancelled(db_url):
    job_id, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids[:1], "w", 60, 3)
        store.cancel_job(s, job_id)
        s.execute(update(Request).where(Request.id == ids[1]).values(status=RequestStatus.pending))
        assert store.claim_requests(s, ids, "w2", 60, 3) == []
        assert s.get(Request, ids[1]).status == RequestStatus.cancelled


def test_cancel_of_a_finished_job_changes_nothing(db_url):
    job_id, ids = make_job(db_url, 1)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.record_result(s, ids[0], output(), "w")
        store.refresh_job(s, job_id)
        job = store.cancel_job(s, job_id)
        assert (job.status, job.cancel_requested_at) == (JobStatus.completed, None)


def test_summary_counts_and_statistics(db_url):
    job_id, ids = make_job(db_url, 4)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w1", 60, 3)
        store.start_requests(s, ids, "w1")
        # request 0: 10 tokens, 8 drafted / 6 accepted over 4 steps; request 1: 2 tokens, 2 drafted / 0
        store.record_result(s, ids[0], output(new_tokens=10, drafted=8, accepted=6, steps=4, wall=1.0,
                                              wins={"d1": 3, "ngram": 1}), "w1")
        store.record_result(s, ids[1], output(new_tokens=2, drafted=2, accepted=0, steps=2, wall=0.5,
                                              app=[0.0], wins={"d1": 0}), "w2")
        store.record_failure(s, ids[2], "boom", "w2")
        store.refresh_job(s, job_id)
    with f.begin() as s:
        summary = store.job_summary(s, job_id)
        assert summary["request_counts"] == counts_from_rows(s, job_id)
    assert summary["id"] == job_id and summary["status"] == "running"
    assert summary["request_counts"] == {"total": 4, "pending": 0, "running": 1, "completed": 2, "failed": 1,
                                         "cancelled": 0}
    st = summary["stats"]
    assert st["results"] == 2 and st["tokens_generated"] == 12 and st["prompt_tokens"] == 10
    assert st["acceptance_rate"]["token_weighted"] == pytest.approx(6 / 10)
    assert st["acceptance_rate"]["request_mean"] == pytest.approx((6 / 8 + 0 / 2) / 2)
    assert st["mean_acceptance_length"]["token_weighted"] == pytest.approx((6 + 6) / 6)
    assert st["mean_acceptance_length"]["request_mean"] == pytest.approx(((6 + 4) / 4 + (0 + 2) / 2) / 2)
    assert st["accepted_per_position"] == pytest.approx([0.25, 0.25])
    assert st["pool_wins"] == {"d1": 3, "ngram": 1}
    assert st["generation_seconds_sum"] == pytest.approx(1.5)
    assert "generation_seconds" not in st and "verify_seconds" not in st   # sums say they are sums
    assert st["tokens_per_second"] == pytest.approx(12 / st["wall_clock_seconds"])
    assert st["latency_seconds"]["p50"] <= st["latency_seconds"]["p95"] <= st["latency_seconds"]["max"]
    workers = {w["worker"]: w for w in st["workers"]}
    assert (workers["w1"]["requests"], workers["w1"]["tokens_generated"]) == (1, 10)
    assert workers["w2"]["busy_tokens_per_second"] == pytest.approx(2 / 0.5)


def test_latencies_leave_results_cache_hits_out_and_count_them_beside(db_url):
    """A results-cache hit is answered at once (latency 0, nothing decoded): counted as a latency,
    two hits among five results pulled p50 from 2 s to 1 s. The latencies are the generated
    results'; the hits are counted beside them."""
    job_id, ids = make_job(db_url, 5)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.start_requests(s, ids[:3], "w")
        for i in ids[:3]:
            store.record_result(s, i, output(), "w")
        source = s.scalars(select(Result).where(Result.request_id == ids[0])).one()
        for i in ids[3:]:
            assert store.record_cached_result(s, i, source, "w")
        for i, seconds in zip(ids[:3], (1.0, 2.0, 3.0)):       # the generated ones' latencies, fixed
            s.execute(update(Result).where(Result.request_id == i).values(latency_seconds=seconds))
        store.refresh_job(s, job_id)
    with f.begin() as s:
        st = store.job_summary(s, job_id)["stats"]
    assert st["results"] == 5 and st["cache_hits"] == 2
    assert st["latency_seconds"] == {"p50": 2.0, "p95": pytest.approx(2.9), "mean": 2.0, "max": 3.0,
                                     "cache_hits": 2}


def test_the_grammars_forced_tokens_are_stored_and_summed(db_url):
    job_id, ids = make_job(db_url, 3)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w1", 60, 3)
        store.start_requests(s, ids, "w1")
        structured = output(new_tokens=10)
        structured.stats.grammar_drafted_tokens, structured.stats.grammar_accepted_tokens = 7, 6
        store.record_result(s, ids[0], structured, "w1")
        store.record_result(s, ids[1], output(new_tokens=10), "w1")        # free text: 0 and 0
        store.record_result(s, ids[2], output(new_tokens=4), "w1")
        s.execute(update(Result).where(Result.request_id == ids[2])      # a row from before 0014
                  .values(grammar_drafted_tokens=None, grammar_accepted_tokens=None))
        store.refresh_job(s, job_id)
    with f.begin() as s:
        rows = {r.request_id: r for r in s.scalars(select(Result).where(Result.job_id == job_id))}
        st = store.job_summary(s, job_id)["stats"]
    assert (rows[ids[0]].grammar_drafted_tokens, rows[ids[0]].grammar_accepted_tokens) == (7, 6)
    assert (rows[ids[1]].grammar_drafted_tokens, rows[ids[1]].grammar_accepted_tokens) == (0, 0)
    assert (st["grammar_drafted_tokens"], st["grammar_accepted_tokens"]) == (7, 6)
    assert st["grammar_token_share"] == pytest.approx(6 / 24)


def test_a_workers_busy_time_counts_rows_decoded_together_once(db_url, monkeypatch):
    """Two rows of one batch, each 1 s from admission to completion and finished together, kept
    the worker busy for about 1 s, not 2: busy tokens/s is the rate while generating."""
    from specbatch.db.models import utcnow
    from specbatch.jobs.stats import _covered_seconds

    # "finished together": one clock reading for both results, however slow the database is
    finished = utcnow()
    monkeypatch.setattr(store, "utcnow", lambda: finished)

    assert _covered_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    assert _covered_seconds([]) == 0.0
    job_id, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.start_requests(s, ids, "w")
        for i in ids:
            store.record_result(s, i, output(new_tokens=10, wall=1.0), "w")
    with f.begin() as s:
        (worker,) = store.job_summary(s, job_id)["stats"]["workers"]
    assert worker["busy_seconds"] == pytest.approx(1.0)
    assert worker["busy_tokens_per_second"] == pytest.approx(20.0)


def test_summary_of_a_job_without_results(db_url):
    job_id, _ = make_job(db_url, 2)
    with db.session_factory(db_url).begin() as s:
        st = store.job_summary(s, job_id)["stats"]
    assert st["results"] == 0 and st["tokens_generated"] == 0
    assert st["acceptance_rate"] == {"token_weighted": None, "request_mean": None}
    assert st["latency_seconds"]["p50"] is None and st["tokens_per_second"] is None and st["workers"] == []


def test_deleting_a_job_removes_its_rows(db_url):
    job_id, ids = make_job(db_url, 2)
    f = db.session_factory(db_url)
    with f.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.record_result(s, ids[0], output(), "w")
    with f.begin() as s:
        s.execute(Job.__table__.delete().where(Job.id == job_id))
    with f.begin() as s:
        assert s.scalar(select(func.count()).select_from(Request)) == 0
        assert s.scalar(select(func.count()).select_from(Result)) == 0
        assert store.record_result(s, ids[1], output(), "w") is False     # the job is gone: dropped


def test_a_batch_id_names_its_job(db_url):
    """An HTTP API user holds a batch id (batch_...), not the job's: `specbatch audit`, `status`,
    `export` and the rest take it (they said "no job 'batch_...'", and only GET /v1/batches/ID/stats
    told the job id). A batch whose file failed validation has no job, and says why."""
    from specbatch.db.models import ApiBatch

    job_id, _ = make_job(db_url, 1)
    with db.session_factory(db_url).begin() as s:
        for batch_id, job in (("batch_0123456789abcdef01234567", job_id), ("batch_fedcba987654321001234567", None)):
            s.add(ApiBatch(id=batch_id, job_id=job, input_file_id="file-x", endpoint="/v1/completions",
                           completion_window="24h", meta={}, expires_at=utcnow()))
    with db.session_factory(db_url).begin() as s:
        assert store.get_job(s, "batch_0123456789abcdef01234567").id == job_id
        with pytest.raises(JobNotFound, match=r"^batch batch_fedcba987654321001234567 has no job: its input "
                                              r"file failed validation \(GET /v1/batches/batch_fedcba"):
            store.get_job(s, "batch_fedcba987654321001234567")
        with pytest.raises(JobNotFound, match="no job 'batch_nope'; "):
            store.get_job(s, "batch_nope")


@pytest.mark.parametrize("first", ["set_runner", "set_interrupted"])
def test_two_sessions_changing_one_jobs_meta_at_once_both_land(pg_database, first):
    """Two runs of one job on PostgreSQL change different keys of its meta at once: the second
    waits for the first's row lock and reads the meta afresh. set_interrupted read it with no lock
    (its write then overwrote the first's key), and set_runner's FOR UPDATE kept a copy its session
    had read before (tidy53)."""
    import threading

    from sqlalchemy import text

    from tests.db.databases import empty_tables

    empty_tables(pg_database)
    job_id, _ = make_job(pg_database, 1)
    changes = {"set_runner": lambda s: store.set_runner(s, job_id, "embedded@host:1"),
               "set_interrupted": lambda s: store.set_interrupted(s, job_id, True)}
    second = next(name for name in changes if name != first)
    f = db.session_factory(pg_database)
    done: list[BaseException | None] = []

    def change_second() -> None:
        try:
            with f.begin() as s:
                job = store.get_job(s, job_id)      # the run read its job before: its session holds it
                changes[second](s)
                assert job.meta is not None
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - the main thread raises it
            done.append(e)

    with f.begin() as s:
        changes[first](s)                      # flushed, not committed: the row is locked
        thread = threading.Thread(target=change_second)
        thread.start()
        with db.get_engine(pg_database).connect() as watch:     # until the second waits for that lock
            while not done and not watch.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'")).scalar():
                time.sleep(0.01)
    thread.join()
    assert done == [None]
    with f.begin() as s:
        meta = store.get_job(s, job_id).meta
    assert meta["run_by"] == ["embedded@host:1"] and "interrupted_at" in meta and meta["who"] == "test", meta
