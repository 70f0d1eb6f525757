"""transact: one transaction per try, arguments passed (not captured), transient errors retried."""

from __future__ import annotations

import pytest
import sqlalchemy.exc as sa_exc
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from specbatch.worker import transaction
from specbatch.worker.transaction import transact


def test_a_transient_error_reruns_the_whole_transaction_with_the_same_arguments(monkeypatch, tmp_path):
    monkeypatch.setattr(transaction.time, "sleep", lambda _s: None)
    sf = sessionmaker(create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    with sf.begin() as s:
        s.execute(text("CREATE TABLE t (x INTEGER)"))
    tries = []

    def insert(s, x, *, fail_first):
        s.execute(text("INSERT INTO t VALUES (:x)"), {"x": x})
        tries.append(x)
        if fail_first and len(tries) == 1:
            raise sa_exc.OperationalError("INSERT", {}, Exception("server closed the connection"))
        return x

    got = [transact(sf, insert, x, fail_first=True) for x in (1, 2)]
    assert got == [1, 2] and tries == [1, 1, 2]
    with sf.begin() as s:    # the failed try was rolled back: each row once
        assert [r[0] for r in s.execute(text("SELECT x FROM t ORDER BY x"))] == [1, 2]


def test_an_error_that_stays_propagates_after_the_last_attempt(monkeypatch, tmp_path):
    monkeypatch.setattr(transaction.time, "sleep", lambda _s: None)
    sf = sessionmaker(create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    calls = []

    def down(s):
        calls.append(1)
        raise sa_exc.OperationalError("SELECT 1", {}, Exception("connection refused"))

    with pytest.raises(sa_exc.OperationalError):
        transact(sf, down)
    assert len(calls) == transaction.ATTEMPTS
