"""``GET /healthz``: the database and the broker, each answered within a bounded time. No key
needed (load balancers probe it); the answer names no URL or credential."""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from specbatch.api.deps import AppState, State
from specbatch.worker.enqueue import check_broker

logger = logging.getLogger(__name__)

router = APIRouter(tags=["health"])
TIMEOUT = 3.0       # seconds per check; they run side by side


def _database(sb: AppState) -> None:
    with sb.reader.begin() as s:
        s.execute(text("SELECT 1"))


@router.get("/healthz")
def healthz(sb: State) -> JSONResponse:
    checks = {"database": sb.checks.submit(_database, sb),
              "broker": sb.checks.submit(check_broker, sb.settings, TIMEOUT - 1)}
    out: dict[str, Any] = {}
    for name, fut in checks.items():
        try:
            fut.result(timeout=TIMEOUT)
            out[name] = "ok"
        except FutureTimeout:
            out[name] = f"no answer within {TIMEOUT:.0f}s"
        except Exception as e:
            logger.warning("healthz: %s check failed (%s)", name, type(e).__name__)
            out[name] = f"unreachable ({type(e).__name__})"
    ok = all(v == "ok" for v in out.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", **out}, status_code=200 if ok else 503)
