"""examples/results.sql over the specbatch_results view, in SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from specbatch import db
from specbatch.jobs import store
from tests.jobs.test_store import make_job, output

SQL = Path(__file__).resolve().parents[2] / "examples" / "results.sql"


def test_the_per_job_query_counts_requests_and_samples_apart(db_url) -> None:  # noqa: ANN001
    """A new-user walk: a 4-line file, one line with n=3, showed "requests 7" (the view has one row
    per sample)."""
    job_id, ids = make_job(db_url, 4)
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids[:2], "w1", 60, 3)
        three = output()
        three.siblings = [output(), output()]
        for o, i in zip(three.siblings, (1, 2)):
            o.sample_index = i
        store.record_result(s, ids[0], three, "w1")
        store.record_result(s, ids[1], output(), "w1")
        store.refresh_job(s, job_id)
    per_job = SQL.read_text().split(";")[0]
    with db.get_engine(db_url).connect() as conn:
        row = conn.execute(text(per_job)).mappings().one()
    assert (row["requests"], row["samples"], row["completed"]) == (4, 4, 2), dict(row)
    assert row["tokens"] == 4 * 3
