"""Migrations, the models they must match, the SQL view, and SQLite's connection settings."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from specbatch import db
from specbatch.db.models import RESULTS_VIEW, Base, Job, JobStatus, Request
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from tests.db.databases import head_revision

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


def _req(i: int, custom_id: str | None = None) -> ParsedRequest:
    return ParsedRequest(line_no=i, custom_id=custom_id or f"c{i}", kind="completion", prompt=f"p{i}",
                         messages=None, params=PARAMS)


def test_migrated_schema_matches_the_models(db_url):
    with db.get_engine(db_url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []


def test_tables_view_and_revision(db_url):
    insp = inspect(db.get_engine(db_url))
    assert {"jobs", "requests", "results", "alembic_version"} <= set(insp.get_table_names())
    assert RESULTS_VIEW in insp.get_view_names()
    assert db.current_revision(db_url) == head_revision()
    uniques = {tuple(u["column_names"]) for u in insp.get_unique_constraints("requests")}
    assert ("job_id", "custom_id") in uniques
    # one results row per sample of a request (parameter n, migration 0011)
    assert ("request_id", "sample_index") in {tuple(u["column_names"])
                                              for u in insp.get_unique_constraints("results")}


def test_upgrade_is_idempotent_and_downgrade_round_trips(db_url):
    db.upgrade(db_url)                      # already at head: nothing to do
    db.downgrade(db_url, "base")
    insp = inspect(db.get_engine(db_url))
    assert not {"jobs", "requests", "results"} & set(insp.get_table_names())
    assert RESULTS_VIEW not in insp.get_view_names()
    db.upgrade(db_url)
    insp = inspect(db.get_engine(db_url))
    assert "jobs" in insp.get_table_names() and RESULTS_VIEW in insp.get_view_names()


def test_view_has_every_csv_column(db_url):
    """The SQL view and the CSV export describe the same rows: a column added to one is added to both."""
    from specbatch.jobs.table import FLAT_COLUMNS

    cols = {c["name"] for c in inspect(db.get_engine(db_url)).get_columns(RESULTS_VIEW)}
    assert set(FLAT_COLUMNS) <= cols, set(FLAT_COLUMNS) - cols


def test_unique_custom_id_per_job(db_url):
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        job = store.create_job(s, target="t", drafts=["ngram"], params={}, requests=[_req(1, "a")],
                               queue="q")
        job_id = job.id
    with pytest.raises(IntegrityError), factory.begin() as s:
        s.add(Request(job_id=job_id, custom_id="a", line_no=2, kind="completion", prompt="x", params={}))
    with factory.begin() as s:    # another job may reuse the custom_id
        store.create_job(s, target="t", drafts=["ngram"], params={}, requests=[_req(1, "a")], queue="q")


def test_datetimes_come_back_aware_utc(db_url):
    t = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        s.add(Job(id="tzjob", status=JobStatus.queued, target="t", drafts=[], queue="q",
                  params={}, meta={}, created_at=t, updated_at=t))
    with factory.begin() as s:
        got = s.get(Job, "tzjob").created_at
    assert got == t and got.tzinfo is not None and got.utcoffset() == timedelta(0)
    with pytest.raises(Exception, match="naive"), factory.begin() as s:
        s.add(Job(id="naive", status=JobStatus.queued, target="t", drafts=[], queue="q",
                  params={}, meta={}, created_at=datetime(2024, 1, 1), updated_at=t))


def test_view_joins_requests_and_results_in_plain_sql(db_url):
    from specbatch.engine.types import GenerationOutput, GenerationStats

    factory = db.session_factory(db_url)
    with factory.begin() as s:
        job = store.create_job(s, target="t", drafts=["d"], params={},
                               requests=[_req(1), _req(2)], queue="q")
        job_id = job.id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w", 60, 3)
        out = GenerationOutput("hi", [5, 6], "stop", GenerationStats(prompt_tokens=3, new_tokens=2,
                               verify_steps=1, drafted_tokens=4, accepted_tokens=1, wall_seconds=0.5))
        store.record_result(s, ids[0], out, "w", models={"target": "t-used", "drafts": ["d"], "lossy": True})
        store.record_failure(s, ids[1], "too long", "w", param="max_tokens")
    with db.get_engine(db_url).connect() as conn:
        rows = conn.execute(text(f"SELECT custom_id, status, text, completion_tokens, acceptance_rate, "
                                 f"worker, target, lossy, cached, error_type, error_param, drafts "
                                 f"FROM {RESULTS_VIEW} WHERE job_id = :j ORDER BY line_no"),
                            {"j": job_id}).all()
    with db.get_engine(db_url).connect() as conn:   # a JSON column left empty reads as SQL NULL
        empty = conn.execute(text(f"SELECT COUNT(*) FROM {RESULTS_VIEW} WHERE job_id = :j AND messages IS NULL "
                                  "AND prompt_ids IS NULL AND metadata IS NULL"), {"j": job_id}).scalar()
    assert empty == 2
    # the newer columns (migration 0007): who produced a result (recorded, else the job's pair)
    drafts = [json.loads(r[-1]) if isinstance(r[-1], str) else r[-1] for r in rows]
    assert drafts == [["d"], ["d"]]
    assert [tuple(r)[:-1] for r in rows] == [
        ("c1", "completed", "hi", 2, 0.25, "w", "t-used", True, False, None, None),
        ("c2", "failed", None, None, None, None, "t", None, None, "invalid_request_error", "max_tokens")]


def test_sqlite_runs_wal_with_busy_timeout_and_foreign_keys(tmp_path):
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'new.db'}"
    assert db.sqlite_path(url) == tmp_path / "a" / "b" / "new.db"
    try:
        with db.get_engine(url).connect() as conn:       # creates parents, file, schema
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.SQLITE_BUSY_TIMEOUT_MS
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert (tmp_path / "a" / "b" / "new.db").exists()
        assert db.current_revision(url) == head_revision()
    finally:
        db.forget_engines()


def test_sqlite_path_of_other_urls():
    assert db.sqlite_path("sqlite://") is None
    assert db.sqlite_path("sqlite:///:memory:") is None
    assert db.sqlite_path("postgresql+psycopg://u@h/db") is None


def test_in_memory_sqlite_keeps_its_tables():
    try:
        factory = db.session_factory("sqlite://")
        with factory.begin() as s:
            store.create_job(s, target="t", drafts=["ngram"], params={}, requests=[_req(1)], queue="q")
        with factory.begin() as s:
            assert len(store.list_jobs(s)) == 1
    finally:
        db.forget_engines()


def test_a_database_from_a_newer_specbatch_is_refused(tmp_path):
    from specbatch.errors import SpecBatchError

    url = f"sqlite:///{tmp_path / 'new.db'}"
    try:
        with db.get_engine(url).begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
        db.forget_engines()
        with pytest.raises(SpecBatchError, match="revision 9999, newer than this specbatch knows"):
            db.get_engine(url)
    finally:
        db.forget_engines()


def test_0005_adds_the_results_cache_to_existing_rows(db_url):
    """Upgrading a database with jobs and results: old results are plain generated rows (no key,
    not cached) and old jobs use the cache; the key is indexed for the lookup."""
    from sqlalchemy import select

    from specbatch.db.models import Result
    from specbatch.engine.types import GenerationOutput, GenerationStats

    db.downgrade(db_url, "0004")      # the revision before the results cache (0005)
    with db.get_engine(db_url).begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, status, target, drafts, ngram, queue, params, metadata, total, "
                          "pending, running, completed, failed, cancelled, created_at, updated_at) VALUES "
                          "('old', 'queued', 't', '[]', false, 'q', '{}', '{}', 0, 0, 0, 0, 0, 0, "
                          "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
    db.upgrade(db_url)
    assert db.current_revision(db_url) == head_revision()
    insp = inspect(db.get_engine(db_url))
    assert {"ix_results_cache_key": ["cache_key"]}.items() <= {
        i["name"]: i["column_names"] for i in insp.get_indexes("results")}.items()
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        assert s.get(Job, "old").cache is True
        job = store.create_job(s, target="t", drafts=[], params={}, requests=[_req(1)], queue="q")
        ids = store.resumable_request_ids(s, job.id)
        store.claim_requests(s, ids, "w", 60, 3)
        store.record_result(s, ids[0], GenerationOutput("hi", [5], "stop", GenerationStats()), "w")
        res = s.scalars(select(Result)).one()
        assert (res.cached, res.cache_key, res.cached_from) == (False, None, None)


def test_0008_gives_old_cache_hits_a_start(db_url):
    """A hit stored with started_at NULL (before 0008) starts when it finished; generated rows keep theirs."""
    from sqlalchemy import select

    from specbatch.db.models import Result
    from specbatch.engine.types import GenerationOutput, GenerationStats

    factory = db.session_factory(db_url)
    with factory.begin() as s:
        job = store.create_job(s, target="t", drafts=[], params={}, requests=[_req(1), _req(2)],
                               queue="q")
        ids = store.resumable_request_ids(s, job.id)
        store.claim_requests(s, ids, "w", 60, 3)
        store.start_requests(s, ids[:1], "w")
        store.record_result(s, ids[0], GenerationOutput("hi", [5], "stop", GenerationStats()), "w")
        store.record_cached_result(s, ids[1], s.scalars(select(Result)).one(), "w")
    db.forget_engines()
    db.downgrade(db_url, "0007")
    with db.get_engine(db_url).begin() as conn:      # as 0007's record_cached_result left a hit
        conn.execute(text("UPDATE results SET started_at = NULL WHERE cached"))
        generated_start = conn.execute(text("SELECT started_at FROM results WHERE NOT cached")).scalar_one()
    db.upgrade(db_url)
    assert db.current_revision(db_url) == head_revision()
    with db.session_factory(db_url).begin() as s:
        generated, hit = s.scalars(select(Result).order_by(Result.id)).all()
        assert hit.cached and hit.started_at == hit.finished_at
        assert not generated.cached and generated.started_at is not None
    with db.get_engine(db_url).connect() as conn:
        assert conn.execute(text("SELECT started_at FROM results WHERE NOT cached")).scalar_one() == generated_start


def test_a_server_sized_pool_keeps_a_connection_per_thread(db_url):
    """SQLAlchemy keeps 5 connections by default; the API runs SPECBATCH_API_THREADS routes at once,
    and with 5 kept it opened and closed a connection for most requests under load (issue 32)."""
    db.session_factory(db_url)                               # cached with the default pool first
    factory = db.session_factory(db_url, readonly=True, pool_size=24)
    engine = db.get_engine(db_url)
    assert factory.kw["bind"].pool is engine.pool and engine.pool.size() == 24
    assert db.session_factory(db_url).kw["bind"] is engine    # the writer's factory rebuilt on it
    assert db.get_engine(db_url, pool_size=8) is engine      # a smaller ask keeps the bigger pool


def test_0015_folds_the_ngram_flag_into_the_pool(db_url):
    """Jobs written before 0015 (drafts + the ngram flag) read back as the same pool, on the same
    queue; downgrading splits the flag back out."""
    from specbatch.engine.drafter_specs import pool_fields
    from specbatch.worker.queues import queue_name

    db.downgrade(db_url, "0014")
    with db.get_engine(db_url).begin() as conn:
        for job_id, drafts, ngram in (("flag", '["d1"]', "true"), ("plain", '["d1"]', "false"),
                                      ("alone", '[]', "true")):
            conn.execute(text(
                "INSERT INTO jobs (id, status, target, drafts, ngram, queue, params, metadata, cache, total, "
                "pending, running, completed, failed, cancelled, created_at, updated_at) VALUES "
                f"('{job_id}', 'queued', 't', '{drafts}', {ngram}, 'q', '{{}}', '{{}}', true, 0, 0, 0, 0, 0, "
                "0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
    db.forget_engines()
    db.upgrade(db_url)
    assert db.current_revision(db_url) == head_revision()
    assert "ngram" not in {c["name"] for c in inspect(db.get_engine(db_url)).get_columns("jobs")}
    with db.session_factory(db_url).begin() as s:
        pools = {j: s.get(Job, j).drafts for j in ("flag", "plain", "alone")}
        assert pools == {"flag": ["d1", "ngram"], "plain": ["d1"], "alone": ["ngram"]}
        assert queue_name("t", pools["flag"]) == queue_name("t", ["ngram", "d1"])
        assert store.job_dict(s.get(Job, "flag"))["ngram"] is True
        assert pool_fields(pools["plain"]) == {"drafts": ["d1"], "ngram": False, "drafters": ["d1"]}
    db.forget_engines()
    db.downgrade(db_url, "0014")
    with db.get_engine(db_url).connect() as conn:
        rows = conn.execute(text("SELECT id, drafts, ngram FROM jobs ORDER BY id")).all()
    assert [(i, json.loads(d) if isinstance(d, str) else d, bool(n)) for i, d, n in rows] == [
        ("alone", [], True), ("flag", ["d1"], True), ("plain", ["d1"], False)]
    db.forget_engines()
    db.upgrade(db_url)


def test_migrating_logs_no_alembic_set_up_lines(tmp_path):
    """A worker logs at INFO; alembic logged seven "setup plugin ..." lines per process there, as
    importing alembic.config sets its plugins up. A fresh interpreter: alembic must not be imported yet."""
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from specbatch import db\n"
            f"db.session_factory('sqlite:///{tmp_path / 'x.db'}')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.db").exists()
    assert "INFO:alembic" not in done.stderr and "setup plugin" not in done.stderr, done.stderr


def test_the_schema_head_constant_is_the_newest_migration():
    """A new migration bumps db.SCHEMA_HEAD: else a database at the old head passed the cheap check."""
    assert db.SCHEMA_HEAD == head_revision()


def test_opening_a_database_at_head_reads_no_migration_script(db_url):
    """The check of every command's first connection: one SELECT of the version, no Alembic (its
    import and the migration scripts took 1.7 s of a `specbatch status` at load 10); and a database
    one migration behind is still brought to head."""
    import subprocess
    import sys

    code = ("import sys\nfrom specbatch import db\n"
            f"db.session_factory({db_url!r})\n"
            "print(sorted(m for m in ('alembic', 'mako') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    db.forget_engines()
    db.downgrade(db_url, "0014")
    db.forget_engines()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['alembic', 'mako']"     # a database behind: the full check, and the upgrade
    assert db.current_revision(db_url) == head_revision()
