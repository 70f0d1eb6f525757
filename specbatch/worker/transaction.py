"""Short database transactions for the worker, retried whole on transient errors.

    claimed = transact(sf, store.claim_requests, ids, worker, lease_seconds, max_attempts)

``transact`` runs ``fn(session, *args)`` in one ``sf.begin()`` block; ``with_db_retry`` retries a
callable that opens its own transactions (it must be safe to run again from the start). Arguments
are passed, not captured: a function built in a loop would otherwise need its loop variables bound
through default arguments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

logger = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

TRANSIENT_DB_ERRORS: tuple[type[BaseException], ...] = (sa_exc.OperationalError, sa_exc.InterfaceError)
# errors a retry cannot fix (e.g. text PostgreSQL refuses): the request is failed with the reason
PERMANENT_DB_ERRORS: tuple[type[BaseException], ...] = (sa_exc.DataError, sa_exc.IntegrityError)
ATTEMPTS = 6
FIRST_DELAY = 0.2           # seconds, doubled after each failure up to MAX_DELAY
MAX_DELAY = 5.0


def with_db_retry(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, retried with backoff while it fails with a transient database error."""
    delay = FIRST_DELAY
    for i in range(ATTEMPTS):
        try:
            return fn(*args, **kwargs)
        except TRANSIENT_DB_ERRORS as e:
            if i == ATTEMPTS - 1:
                raise
            logger.warning("database error, retrying in %.1fs: %s", delay, e)
            time.sleep(delay)
            delay = min(delay * 2, MAX_DELAY)
    raise AssertionError("unreachable")


def transact(sf: Any, fn: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(session, *args, **kwargs)`` in one transaction of the session factory ``sf``, the whole
    transaction retried on transient errors."""
    def once() -> T:
        with sf.begin() as s:
            return fn(s, *args, **kwargs)
    return with_db_retry(once)
