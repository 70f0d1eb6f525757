"""The API's reads on SQLite and PostgreSQL (issue 32, item 7): a read opens no transaction on
PostgreSQL (no BEGIN, no COMMIT: two round trips a read), a batch's request counts and usage come
in one statement, a page's statement is built once per shape, and a pooled PostgreSQL connection is
pinged before use only after it sat idle."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, exc, text

from specbatch import db
from specbatch.db.models import ApiFile
from specbatch.jobs import batches, files, store
from specbatch.jobs.intake import ParsedRequest
from tests.jobs.test_store import PARAMS, output


def _job(s: Any, n: int) -> tuple[str, list[int]]:
    reqs = [ParsedRequest(line_no=i + 1, custom_id=f"c{i}", kind="completion", prompt="p", messages=None,
                          params=PARAMS) for i in range(n)]
    job = store.create_job(s, target="t", drafts=["d"], params={}, requests=reqs, queue="q")
    return job.id, store.resumable_request_ids(s, job.id)


class Sent:
    """The statements a database's engines (``get_engine``'s and, on PostgreSQL, ``read_engine``'s)
    send while counting (SQLite's BEGIN is in-process: not counted)."""

    def __init__(self, url: str) -> None:
        main = db.get_engine(url)
        self.engines = [main] if main.dialect.name == "sqlite" else [main, db.read_engine(url)]
        self.statements: list[str] = []
        self.in_transaction: list[bool] = []
        self.counting = False

    def __enter__(self) -> Sent:
        for engine in self.engines:
            event.listen(engine, "before_cursor_execute", self._before)
            event.listen(engine, "after_cursor_execute", self._after)
        self.counting = True
        return self

    def __exit__(self, *_: Any) -> None:
        self.counting = False
        for engine in self.engines:
            event.remove(engine, "before_cursor_execute", self._before)
            event.remove(engine, "after_cursor_execute", self._after)

    def _before(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.counting and statement.strip().upper() != "BEGIN":
            self.statements.append(statement)

    def _after(self, conn: Any, *_: Any) -> None:
        info = getattr(conn.connection.dbapi_connection, "info", None)     # psycopg's connection state
        if self.counting and info is not None and hasattr(info, "transaction_status"):
            import psycopg.pq

            self.in_transaction.append(info.transaction_status != psycopg.pq.TransactionStatus.IDLE)


def test_an_api_read_opens_no_transaction_on_postgresql(db_url: str) -> None:
    reads = db.read_engine(db_url)
    with Sent(db_url) as sent, reads.connect() as c:
        assert files.list_files(c, limit=5) == ([], False)
    assert len(sent.statements) == 1
    if db_url.startswith("postgresql"):
        assert sent.in_transaction == [False]
        # the export's reader keeps its snapshot: a transaction
        with Sent(db_url) as sent, db.session_factory(db_url, readonly=True).begin() as s:
            files.list_files(s, limit=5)
        assert sent.in_transaction == [True]
    else:   # SQLite's BEGIN costs no round trip: the read-only view, whose BEGIN never blocks a writer
        assert reads.get_execution_options()["specbatch_readonly"] is True


def test_request_counts_and_usage_come_in_one_statement(db_url: str) -> None:
    two = output()
    two.siblings = [output(new_tokens=5)]       # n=2: the prompt counted once, both completions
    two.siblings[0].sample_index = 1
    with db.session_factory(db_url).begin() as s:
        busy, ids = _job(s, 5)
        idle, _ = _job(s, 2)
        store.claim_requests(s, ids[:4], "w", 60, 4)
        store.record_result(s, ids[0], output(), "w")
        store.record_result(s, ids[1], two, "w")
        store.record_failure(s, ids[2], "bad", "w")
        expected = store.request_counts(s, [busy, idle])
    with Sent(db_url) as sent, db.read_engine(db_url).connect() as c:
        counts, usage = batches.tallies(c, [busy, idle, "job_none"])
    assert len(sent.statements) == 1
    assert counts == {**expected, "job_none": dict.fromkeys(store.COUNT_NAMES, 0)}
    assert counts[busy] == {"total": 5, "pending": 1, "running": 1, "completed": 2, "failed": 1, "cancelled": 0}
    assert usage == {busy: batches.Usage(input_tokens=10, output_tokens=11), idle: batches.Usage()}


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_a_page_of_the_same_shape_reuses_its_statement(db_url: str, order: str) -> None:
    tally = files.Tally()
    tally.feed(b"{}\n")
    with db.session_factory(db_url).begin() as s:
        ids = [files.add_file(s, file_id=files.new_file_id(), purpose=p, filename="f", tally=tally, owner=o).id
               for p, o in [("batch", "a"), ("batch_output", "a"), ("batch", "b"), ("batch", "a")]]
    mine = [i for i, (p, o) in zip(ids, [("batch", "a"), ("batch_output", "a"), ("batch", "b"), ("batch", "a")],
                                   strict=True) if o == "a" and p == "batch"]
    run: list[Any] = []

    def invoked(conn: Any, clauseelement: Any, *_: Any) -> None:
        ordered = bool(getattr(clauseelement, "_order_by_clauses", ()))      # a page, not the cursor's get
        if ordered and ApiFile.__table__ in clauseelement.get_final_froms():
            run.append(clauseelement)

    engine = db.read_engine(db_url)
    event.listen(engine, "before_execute", invoked)
    try:
        with engine.connect() as c:
            pages = [files.list_files(c, limit=1, order=order, owner="a", purpose="batch") for _ in range(2)]
            first = pages[0][0][0].id
            after = [files.list_files(c, limit=5, order=order, owner="a", purpose="batch", after=first)
                     for _ in range(2)]
            every = files.list_files(c, limit=10, order=order)
    finally:
        event.remove(engine, "before_execute", invoked)
    listed = [f.id for f in every[0]]
    assert sorted(listed) == sorted(ids) and len(listed) == 4
    expected = [i for i in listed if i in mine]
    assert [([f.id for f in rows], more) for rows, more in pages] == [([expected[0]], True)] * 2
    assert [([f.id for f in rows], more) for rows, more in after] == [(expected[1:], False)] * 2
    # two of each shape: the second run of a shape is the first one's statement, not a new build
    assert len(run) == 5 and run[0] is run[1] and run[2] is run[3] and run[0] is not run[2]


def test_a_postgresql_connection_is_pinged_only_after_it_sat_idle(pg_database: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A ping is a round trip: a busy connection is not pinged; one idle past IDLE_PING_SECONDS is,
    and one the server closed meanwhile (a restart) is replaced without failing the read."""
    import psycopg

    from tests.db.databases import PG_ADMIN_DSN

    db.forget_engines()
    engine = db.read_engine(pg_database)
    pings: list[int] = []
    ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda conn: pings.append(1) or ping(conn))

    def read() -> int:
        with engine.connect() as c:
            return int(c.execute(text("SELECT 1")).scalar_one())

    def restart() -> None:      # the server's side of a restart: every connection to the database closed
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                          [engine.url.database])

    try:
        monkeypatch.setattr(db, "IDLE_PING_SECONDS", 3600.0)
        assert [read(), read(), read()] == [1, 1, 1] and pings == []
        restart()       # used a moment ago and not pinged: the first read fails, the pool drops the rest
        with pytest.raises(exc.OperationalError):
            read()
        assert read() == 1
        monkeypatch.setattr(db, "IDLE_PING_SECONDS", 0.0)
        restart()
        assert read() == 1 and pings == [1]
    finally:
        db.forget_engines()
