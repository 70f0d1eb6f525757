"""Tests only, imported by a worker's parent (Celery imports the app's ``imports`` as it builds the
worker) and by its pool child: the parent holds its start-up at one moment until it is sent a
SIGTERM, so a test signals it exactly there. It writes the file SPECBATCH_TEST_HELD once held.
SPECBATCH_TEST_HOLD names the moment:

- "import": here, while Celery imports the app's modules, before it installs its SIGTERM handler;
- "pool": as the pool is about to spawn its child: Celery's handler is installed (it only sets a
  flag), the consumer has not started, and the child spawned next loads (gated_load_hook).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from billiard.process import current_process
from celery import signals
from celery.worker import state

HOLD_SECONDS = 120      # then go on: a test that never signals fails on its own timeout, not here


def _held() -> None:
    Path(os.environ["SPECBATCH_TEST_HELD"]).touch()


if current_process().name == "MainProcess":
    moment = os.environ["SPECBATCH_TEST_HOLD"]
    if moment == "import":
        _held()
        time.sleep(HOLD_SECONDS)      # a SIGTERM lands here
    elif moment == "pool":
        @signals.worker_before_create_process.connect(weak=False)
        def _hold_until_stopped(**_: object) -> None:
            _held()
            deadline = time.monotonic() + HOLD_SECONDS
            while state.should_stop is None and time.monotonic() < deadline:
                time.sleep(0.05)
