"""process_chunk with a fake engine on a real SQLite file (unit level: the engine is faked)."""

from __future__ import annotations

import json

import sqlalchemy.exc as sa_exc
from sqlalchemy import select

from specbatch.config import Settings
from specbatch.engine.types import GenerationOutput, GenerationStats
from specbatch.jobs import intake, store
from specbatch.worker.chunk import process_chunk


class FakeEngine:
    batch_size = 1

    def rows_now(self):   # as Engine's before the autopilot decoded anything
        return None if self.batch_size == "auto" else self.batch_size

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        """Decodes what it is given, then (``more``) what a batch with free places claims, as the
        real engine's refill does, until a claim finds none."""
        requests, done = list(requests), 0
        while done < len(requests):
            if on_start is not None:
                on_start(list(range(done, len(requests))))
            for i in range(done, len(requests)):
                yield i, GenerationOutput("ok", [1, 2], "length", GenerationStats(new_tokens=2, verify_steps=1))
            done = len(requests)
            if more is not None:
                requests += more(batch_size if isinstance(batch_size, int) else 8)


def _job(tmp_path, n, prompt=lambda i: "hi"):
    from specbatch.db import session_factory

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": prompt(i)}) + "\n" for i in range(n)))
    parsed = intake.parse_file(path, {}, settings)
    with session_factory(settings.database_url).begin() as s:
        job = store.create_job(s, target="t", drafts=["d"], params={}, requests=parsed, queue="q")
        return settings, job.id, list(store.resumable_request_ids(s, job.id))


def test_a_result_that_cannot_be_stored_fails_its_request_and_the_job_goes_on(tmp_path, monkeypatch):
    from specbatch.db import session_factory

    settings, job_id, ids = _job(tmp_path, 3)
    real = store.record_result

    def refuse_second(s, request_id, output, worker, **kw):
        if request_id == ids[1]:
            raise sa_exc.DataError("INSERT ...", {}, ValueError("text fields cannot contain NUL"))
        return real(s, request_id, output, worker, **kw)

    monkeypatch.setattr(store, "record_result", refuse_second)
    report = process_chunk(settings, FakeEngine(), ids, "w1")
    assert report.completed == [ids[0], ids[2]] and report.failed == [ids[1]]
    with session_factory(settings.database_url).begin() as s:
        summary = store.job_summary(s, job_id)
    assert summary["status"] == "completed_with_errors"
    assert summary["request_counts"]["failed"] == 1 and summary["request_counts"]["running"] == 0


class RecordingEngine(FakeEngine):
    def __init__(self, batch_size) -> None:
        self.batch_size = batch_size
        self.calls: list[tuple[int, object]] = []

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        self.calls.append((len(requests), batch_size))
        yield from super().generate_many(requests, batch_size, on_start, more)


def test_a_batch_larger_than_the_chunk_claims_ahead_and_tasks_skip_what_it_took(tmp_path):
    settings, job_id, ids = _job(tmp_path, 12)
    engine = RecordingEngine(4)
    report = process_chunk(settings, engine, ids[:2], "w1")     # an 8-request-chunk-like task, B=4
    assert engine.calls == [(8, 4)]                             # 2 of its own + 6 more: 2 x the batch
    assert sorted(report.completed) == ids                      # then the batch claimed the rest as rows finished
    later = process_chunk(settings, engine, ids[2:6], "w2")     # the task that carried those ids
    assert later.completed == [] and sorted(later.finished) == ids[2:6]


def test_a_running_batch_claims_more_of_its_job_but_never_a_suspect_or_another_pairs_request(tmp_path):
    """Refill (docs/DESIGN.md, "Admission order"): the batch stays full across chunks; a request
    that was attempted before runs alone (its own task), and one routed to another pair is left."""
    from sqlalchemy import update

    from specbatch.db import session_factory
    from specbatch.db.models import Request

    settings, job_id, ids = _job(tmp_path, 14)
    with session_factory(settings.database_url).begin() as s:
        s.execute(update(Request).where(Request.id == ids[9]).values(attempts=1))
        s.execute(update(Request).where(Request.id == ids[11]).values(target="other"))
    report = process_chunk(settings, RecordingEngine(2), ids[:1], "w1")
    assert sorted(report.completed) == [i for i in ids if i not in (ids[9], ids[11])]
    with session_factory(settings.database_url).begin() as s:
        left = dict(s.execute(select(Request.id, Request.status).where(Request.job_id == job_id)).all())
    assert left[ids[9]].value == "pending" and left[ids[11]].value == "pending"


class PromptEngine(RecordingEngine):
    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        self.prompts = [r.prompt for r in requests]
        yield from super().generate_many(requests, batch_size, on_start)


def test_claiming_ahead_takes_the_requests_sharing_the_batchs_prompt_prefix_first(tmp_path):
    """Two long system prompts alternate in id order; a chunk of two A requests (as prefix order
    cuts them) tops its batch up with the other A requests first, then B ones, together."""
    a, b = "A" * 80 + " question ", "B" * 80 + " question "
    settings, _, ids = _job(tmp_path, 16, lambda i: (a if i % 2 == 0 else b) + str(i))
    engine = PromptEngine(5)
    process_chunk(settings, engine, [ids[0], ids[2]], "w1")       # 2 of its own + 8 claimed ahead
    assert sorted(p[0] for p in engine.prompts) == ["A"] * 8 + ["B"] * 2


def test_auto_passes_auto_and_batch_one_never_claims_ahead(tmp_path):
    settings, _, ids = _job(tmp_path, 30)
    auto = RecordingEngine("auto")
    process_chunk(settings, auto, ids[:3], "w1")
    assert auto.calls == [(16, "auto")]                         # 2 x 8 before the autopilot measured
    _, _, ids = _job(tmp_path, 30)          # a job of its own: the auto batch claimed all of the first
    one = RecordingEngine(1)
    report = process_chunk(settings, one, ids[16:18], "w2")
    assert one.calls == [(1, 1), (1, 1)] and sorted(report.completed) == ids[16:18]


def test_auto_claims_for_what_the_autopilot_keeps_once_it_is_above_8(tmp_path):
    settings, _, ids = _job(tmp_path, 80)
    auto = RecordingEngine("auto")
    auto.rows_now = lambda: 32                                  # the autopilot keeps 32 rows now
    process_chunk(settings, auto, ids[:2], "w1")
    assert auto.calls == [(64, "auto")]                         # 2 x 32


class DiesMidBatch(FakeEngine):
    """Starts the first ``batch_size`` requests, then the process "dies" (an error escapes)."""

    def __init__(self, batch_size) -> None:
        self.batch_size = batch_size

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):
        on_start(list(range(self.batch_size)))
        raise RuntimeError("killed")
        yield  # a generator, like the real one


def test_a_crash_charges_only_the_rows_being_decoded_not_those_claimed_ahead(tmp_path):
    from specbatch.db import session_factory
    from specbatch.db.models import Request

    settings, job_id, ids = _job(tmp_path, 12)
    try:
        process_chunk(settings, DiesMidBatch(4), ids[:2], "w1")   # holds 8: 4 decoding, 4 queued
    except RuntimeError:
        pass
    with session_factory(settings.database_url).begin() as s:
        rows = s.execute(select(Request.id, Request.status, Request.attempts).order_by(Request.id)).all()
    assert [(r.status.value, r.attempts) for r in rows[:8]] == [("running", 1)] * 4 + [("running", 0)] * 4
    assert [r.attempts for r in rows[8:]] == [0] * 4


def test_lease_keeper_reads_its_ids_under_its_lock_when_renewal_fails(caplog):
    """The renewal thread's warning named ``self._ids`` outside the lock while the decoding thread
    extends it (``add``): it names the ids it tried to renew, copied under the lock."""
    import time

    from specbatch.worker.chunk import LeaseKeeper

    class Failing:
        def begin(self):
            raise RuntimeError("database gone")

    keeper = LeaseKeeper(Failing(), [1, 2], "w1", lease_seconds=0)    # renews every 0.2 s
    unlocked: list[str] = []

    class Watched(list):
        """The keeper's id list: notes each read made without the keeper's lock held."""

        def _check(self, how):
            if not keeper._lock.locked():
                unlocked.append(how)

        def __iter__(self):
            self._check("iter")
            return super().__iter__()

        def __repr__(self):
            self._check("repr")
            return super().__repr__()

    keeper._ids = Watched(keeper._ids)
    with caplog.at_level("WARNING", logger="specbatch.worker.chunk"), keeper:
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    assert caplog.records, "no renewal was attempted"
    assert caplog.records[0].getMessage() == "lease renewal failed for [1, 2]: database gone"
    assert unlocked == []


def _attempted(settings, ids, attempts):
    from sqlalchemy import update

    from specbatch.db import session_factory
    from specbatch.db.models import Request

    with session_factory(settings.database_url).begin() as s:
        for i, n in zip(ids, attempts, strict=True):
            s.execute(update(Request).where(Request.id == i).values(attempts=n))


def test_suspects_decode_batched_until_their_last_attempt_which_runs_alone(tmp_path):
    """A worker SIGKILLed mid-batch leaves every row it decoded a suspect (attempts 1). They ran
    alone, one at a time (a new-user walk: 8 rows recovered at 1.3 against 10 tokens/s); now only
    a request's last attempt runs alone, where a request that kills its worker every time fails by
    itself (max_attempts 3: two batched deaths, then alone, as many deaths as before)."""
    settings, _, ids = _job(tmp_path, 8)
    assert settings.max_attempts == 3
    engine = RecordingEngine(4)
    _attempted(settings, ids[:4], [1, 1, 1, 1])
    report = process_chunk(settings, engine, ids[:4], "w1")
    assert engine.calls == [(4, 4)] and sorted(report.completed) == ids[:4]
    engine.calls.clear()
    _attempted(settings, ids[4:], [0, 1, 2, 2])       # two on their last attempt
    report = process_chunk(settings, engine, ids[4:], "w1")
    assert engine.calls == [(2, 2), (1, 1), (1, 1)] and sorted(report.completed) == ids[4:]


def test_every_claimed_row_keeps_its_lease_while_it_waits_for_its_run(tmp_path, monkeypatch):
    """Rows run one after another (here on their last attempt) kept only the decoding run's lease
    renewed: the others' expired while they waited, the lease sweeper queued them again as if
    their worker had died, and they finished with no worker recorded."""
    from specbatch.worker import chunk

    live: list[chunk.LeaseKeeper] = []

    class Recorded(chunk.LeaseKeeper):
        def __enter__(self):
            live.append(self)
            return super().__enter__()

        def __exit__(self, *exc):
            live.remove(self)
            return super().__exit__(*exc)

    class Checking(RecordingEngine):
        def generate_many(self, requests, batch_size=None, on_start=None, more=None):
            renewed = {i for k in live for i in k._ids}
            self.uncovered.append(sorted(set(ids[:3]) - renewed - set(done)))
            yield from super().generate_many(requests, batch_size, on_start, more)

    monkeypatch.setattr(chunk, "LeaseKeeper", Recorded)
    settings, _, ids = _job(tmp_path, 3)
    _attempted(settings, ids, [2, 2, 2])
    engine, done = Checking(4), []
    engine.uncovered = []
    report = process_chunk(settings, engine, ids, "w1", on_result=lambda e: done.append(e.request_id))
    assert sorted(report.completed) == ids and engine.calls == [(1, 1)] * 3
    assert engine.uncovered == [[], [], []]
